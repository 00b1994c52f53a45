"""Held-out perplexity of converted folders next to the dense model's (the texts and windows: benchmarks/common.py).

python benchmarks/quality/heldout.py outputs/smollm2-carve
python benchmarks/quality/heldout.py outputs/presets/sparse-25 --kl     # and the mean KL(dense || model) per token
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import MAX_TOKENS, OTHER_DOMAINS, TEXTS, heldout_tokens, kl_to_dense, perplexities, report
from llama_moe.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="converted model folders")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="held-out tokens per text")
    parser.add_argument("--texts", nargs="+", default=[*TEXTS, *OTHER_DOMAINS], help="held-out texts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kl", action="store_true", help="also each model's mean KL to the dense model per token")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dense, tokenizer, _ = load_model("default", dtype="float32", device="cpu")
    tokens = heldout_tokens(tokenizer, args.max_tokens, tuple(args.texts))
    reference = perplexities(dense, tokens)
    print(report("dense", reference, reference), flush=True)
    for folder in args.models:
        model, _, _ = load_model(folder, dtype="float32", device="cpu")
        start = time.perf_counter()
        print(report(folder, perplexities(model, tokens), reference), f"[{time.perf_counter() - start:.0f} s]")
        if args.kl:
            kl = kl_to_dense(model, dense, tokens)
            print(f"{folder}: KL(dense || model) per token: " + ", ".join(f"{n} {v:.4f}" for n, v in kl.items()))


if __name__ == "__main__":
    main()

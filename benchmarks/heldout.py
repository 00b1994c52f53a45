"""Held-out perplexity of the conversion benchmarks: the Python tutorial (`data/heldout/tutorial`, the text settings
are tuned on) and the Python HOWTOs (`data/heldout/howto`, the text that confirms them), non-overlapping 256-token
windows over the first 16384 tokens of each, scored as `llama-moe eval --window 256 --stride 256 --max-tokens 16384`
scores them (documents in file order, EOS between them).

    from heldout import heldout_tokens, perplexities          # with benchmarks/ on sys.path
    tokens = heldout_tokens(tokenizer)                         # {"tutorial": [16384], "howto": [16384]}
    dense = perplexities(model, tokens)                        # {"tutorial": ..., "howto": ...}

    python benchmarks/heldout.py outputs/smollm2-carve         # folders' perplexities next to the dense model's

`data/` is not in git: each folder holds the `.rst.txt` sources of CPython's `Doc/tutorial/` and `Doc/howto/`
(Debian's python3.11-doc has them under `usr/share/doc/python3.11/html/_sources/`).
"""

import argparse
import time
from pathlib import Path

import torch

from llama_moe_hf.loading import load_model
from llama_moe_hf.perplexity import sliding_window_perplexity
from llama_moe_hf.text.documents import iter_documents
from llama_moe_hf.text.tokens import token_stream

HELDOUT = Path(__file__).resolve().parents[1] / "data" / "heldout"
TEXTS = ("tutorial", "howto")
WINDOW = 256
MAX_TOKENS = 16384


def heldout_tokens(tokenizer, max_tokens: int = MAX_TOKENS) -> dict[str, torch.Tensor]:
    """The first `max_tokens` tokens `[N]` of each held-out text."""
    missing = [name for name in TEXTS if not (HELDOUT / name).is_dir()]
    if missing:
        raise SystemExit(f"{HELDOUT} lacks {missing}: put the Python docs' .rst.txt sources there (see the docstring).")
    return {name: token_stream(iter_documents(str(HELDOUT / name)), tokenizer, max_tokens) for name in TEXTS}


def perplexities(model, tokens: dict[str, torch.Tensor], batch_size: int = 8) -> dict[str, float]:
    """Perplexity of `model` on each text, over non-overlapping `WINDOW`-token windows."""
    return {
        name: sliding_window_perplexity(model, ids, WINDOW, WINDOW, batch_size).perplexity
        for name, ids in tokens.items()
    }


def report(label: str, result: dict[str, float], dense: dict[str, float]) -> str:
    """One line: each text's perplexity and its ratio to the dense model's."""
    return f"{label}: " + ", ".join(f"{n} {result[n]:.3f} ({result[n] / dense[n]:.3f}x dense)" for n in result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="converted model folders")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="held-out tokens per text")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dense, tokenizer, _ = load_model("default", dtype="float32", device="cpu")
    tokens = heldout_tokens(tokenizer, args.max_tokens)
    reference = perplexities(dense, tokens)
    print(report("dense", reference, reference), flush=True)
    for folder in args.models:
        model, _, _ = load_model(folder, dtype="float32", device="cpu")
        start = time.perf_counter()
        print(report(folder, perplexities(model, tokens), reference), f"[{time.perf_counter() - start:.0f} s]")


if __name__ == "__main__":
    main()

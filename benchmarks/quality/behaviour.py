"""What converted folders keep of the dense model's behaviour (`llama_moe.behaviour`): their greedy
answers to held-out chat prompts next to the dense model's, the KL over its answers, the checkable answers' accuracy,
and KL, next-token agreement and perplexity on held-out text of other domains. One row per model in
benchmarks/results/behaviour.jsonl.

Settings are chosen on one prompt set and one text and confirmed on the others (docs/quality.md):

    python benchmarks/quality/behaviour.py outputs/presets/sparse-50 --set choose     # choose: 214 prompts, man pages
    python benchmarks/quality/behaviour.py outputs/presets/sparse-50 --set confirm    # 214 others, licences, HOWTOs
    python benchmarks/quality/behaviour.py --noise-floor --set confirm                # the dense weights in bfloat16

The prompts (`llama_moe.text.prompts`, templates and offline facts) are split by what they ask about: no
calibration prompt (`builtin:chat`) asks what a held-out one asks. The texts: `benchmarks/common.py` (write them with
`make_heldout.py`), 4,096 tokens of each in 256-token rows.
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import heldout_tokens, record, recorded_calibration
from llama_moe import behaviour
from llama_moe.loading import load_model
from llama_moe.text.prompts import prompts

SETS = {"choose": ("choose", ("manpages",)), "confirm": ("confirm", ("licences", "howto"))}
TEXT_TOKENS = 4096
WINDOW = 256


def rows(tokenizer, texts) -> dict:
    tokens = heldout_tokens(tokenizer, TEXT_TOKENS, texts)
    return {name: ids[: len(ids) // WINDOW * WINDOW].view(-1, WINDOW) for name, ids in tokens.items()}


def line(label: str, numbers: dict, texts) -> str:
    n = numbers["prompts"]
    parts = [
        f"{label}: answers {numbers['answers_match_12']:.1%} begin as dense's ({round(numbers['answers_match_12'] * n)}"
        f"/{n}), {numbers['answers_whole']:.1%} whole, answer KL {numbers['answer_kl']:.3f}, accuracy "
        f"{numbers['accuracy']:.1%} ({numbers['accuracy_share']:.0%} of dense's)"
    ]
    for text in texts:
        ratio = numbers[f"{text}_perplexity"] / numbers[f"{text}_dense_perplexity"]
        parts.append(
            f"{text} KL {numbers[f'{text}_kl']:.3f}, agreement {numbers[f'{text}_agreement']:.1%}, "
            f"perplexity {ratio:.2f}x"
        )
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="converted model folders")
    parser.add_argument("--set", choices=sorted(SETS), default="choose", help="prompts and texts to score on")
    parser.add_argument("--noise-floor", action="store_true", help="also the dense weights rounded to bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    missing = [folder for folder in args.models if not Path(folder, "config.json").is_file()]
    if missing:  # before the dense reference's minutes, not after
        parser.exit(2, f"behaviour.py: not a model folder (no config.json): {', '.join(missing)}\n")
    torch.set_num_threads(args.threads)
    split, texts = SETS[args.set]
    dense, tokenizer, _ = load_model("default", dtype="float32", device="cpu")
    start = time.perf_counter()
    reference = behaviour.dense_reference(dense, tokenizer, prompts(split), rows(tokenizer, texts))
    print(f"dense reference: {len(reference.prompts)} prompts, {time.perf_counter() - start:.0f} s", flush=True)
    candidates = [(folder, lambda f=folder: load_model(f, dtype="float32", device="cpu")[0]) for folder in args.models]
    if args.noise_floor:
        candidates.insert(0, ("dense in bfloat16", lambda: copy.deepcopy(dense).to(torch.bfloat16).float()))
    for label, load in candidates:
        model = load()
        start = time.perf_counter()
        scores = behaviour.score(model, reference)
        numbers = scores.as_dict()
        print(line(label, numbers, texts), f"[{time.perf_counter() - start:.0f} s]", flush=True)
        kinds = {kind: round(share, 3) for kind, (_, share) in scores.by_kind().items()}
        print(f"  match by kind: {kinds}", flush=True)
        calibration = recorded_calibration(model)
        record("behaviour", {"model": label, "set": args.set, "calibration": calibration, **numbers, "kinds": kinds})
        del model


if __name__ == "__main__":
    main()

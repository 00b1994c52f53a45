"""The presets as users run them: `llama-moe convert --preset NAME` timed whole, then held-out perplexity as a ratio
to the dense model on the same tokens, on the Python docs (the calibration corpus's domain) and on two texts of
other domains (Debian's licences and manual pages: `benchmarks/common.py`, written by `make_heldout.py`).

Each preset's row goes to benchmarks/results/presets.jsonl (`"kind": "quality"`), the file `llama-moe convert --help`
reads its measured figures from. The converted folders stay under --root for the speed and export benchmarks.

    python benchmarks/quality/presets.py --presets sparse-25 sparse-50 sparse-75
    python benchmarks/quality/presets.py --presets sparse-50 --evaluate-only      # score folders already converted
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import (
    OTHER_DOMAINS,
    RESULTS,
    TEXTS,
    heldout_tokens,
    perplexities,
    record,
    recorded_calibration,
    report,
)
from llama_moe.commands import main as llama_moe
from llama_moe.loading import load_model

PRESETS_FILE = RESULTS / "presets.jsonl"


def convert(name: str, folder: Path) -> float:
    """Seconds `llama-moe convert --preset name` took, in this process (the quick check off: this script measures)."""
    start = time.perf_counter()
    argv = ["convert", "--preset", name, "--output", str(folder), "--overwrite", "--no-eval", "--no-progress"]
    if llama_moe(argv) != 0:
        raise SystemExit(f"llama-moe convert --preset {name} failed")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", required=True)
    parser.add_argument("--root", type=Path, default=Path("outputs/presets"), help="where the folders are written")
    parser.add_argument("--texts", nargs="+", default=[*TEXTS, *OTHER_DOMAINS])
    parser.add_argument("--evaluate-only", action="store_true", help="score the folders under --root as they are")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.presets:
        seconds = None if args.evaluate_only else convert(name, args.root / name)
        dense, tokenizer, _ = load_model("default", dtype="float32", device="cpu")
        tokens = heldout_tokens(tokenizer, texts=tuple(args.texts))
        reference = perplexities(dense, tokens)
        model, _, _ = load_model(str(args.root / name), dtype="float32", device="cpu")
        result = perplexities(model, tokens)
        print(report(name, result, reference), flush=True)
        row = {"kind": "quality", "preset": name, "convert_seconds": seconds and round(seconds, 1)}
        row |= {"threads": args.threads, "perplexity": result, "dense": reference}
        row["calibration"] = recorded_calibration(model)
        row["ratio"] = {text: round(result[text] / reference[text], 3) for text in result}
        print(json.dumps(row), flush=True)
        record("presets", row, PRESETS_FILE)


if __name__ == "__main__":
    main()

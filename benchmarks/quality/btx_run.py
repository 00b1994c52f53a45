"""Branch-Train-MiX on CPU (recipes/btx/README.md): the dense model, its three branches, their merge before and after
the MiX stage and a prompt-gate merge, scored on each domain's test text and on a general text from none of them.

The branches and the MiX stage run as recipes (their folders hold the tokens and the training seconds); this script
runs the two merges and the evaluation, one stage per command:

    python benchmarks/quality/btx_run.py merge    # outputs/btx/merged (expert_data), -uncentred, -prompts (hidden)
    python benchmarks/quality/btx_run.py eval     # one row per model -> benchmarks/results/btx.jsonl
    python benchmarks/quality/btx_run.py eval --only "BTX's MiX"   # the rows whose names hold these words

Perplexity: non-overlapping 256-token windows over the first `--tokens` tokens of each text (the package's
`sliding_window_perplexity`, as `llama-moe eval --window 256 --stride 256` scores), the same tokens for every model.
`mixture` is the perplexity over the three domains' windows together (their mean log-perplexity).
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import ROOT, perplexities, record

OUT = ROOT / "outputs" / "btx"
DOMAINS = ("prose", "code", "math")
GENERAL = Path("/usr/share/common-licenses/GPL-3")  # Debian's copy of the GPL: text from none of the domains
MERGE_TIMES = OUT / "merge_seconds.json"
PROMPTS = {  # a few prompts per domain for the prompt gate (mergekit's `hidden`)
    "prose": [
        "Return the number of items in the container.",
        "This module provides functions for working with dates and times.",
        "Raise an exception if the file cannot be opened.",
    ],
    "code": ["def read_file(path):\n    with open(path) as f:", "import os\n\nclass Parser:\n    def __init__(self):"],
    "math": [
        "Ana has 50 stickers. She gets 36 more. How many stickers does she have?",
        "Tom buys 3 boxes of 12 pencils. The answer is",
    ],
}
MODELS = {  # row name: (folder, stage that made it)
    "dense SmolLM2-135M-Instruct": (None, "none"),
    "branch prose": (OUT / "branch-prose", "branch"),
    "branch code": (OUT / "branch-code", "branch"),
    "branch math": (OUT / "branch-math", "branch"),
    "merged 3x top-2, expert_data gate (before MiX)": (OUT / "merged", "merge"),
    "merged 3x top-2, expert_data gate uncentred (before MiX)": (OUT / "merged-uncentred", "merge"),
    "merged, after MiX (routers trained)": (OUT / "mixed", "mix"),
    "merged, after BTX's MiX (every weight, 120 steps)": (OUT / "mixed-long", "mix"),
    "merged 3x top-2, hidden gate (prompts)": (OUT / "merged-prompts", "merge"),
}


def merge_stage() -> None:
    """The BTX merge (recipes/btx/merge.yaml), the same with uncentred `expert_data` rows and with mergekit's `hidden`
    prompt gate, timed."""
    import dataclasses

    from llama_moe.conversion.settings import RunOptions
    from llama_moe.merging.config import config_from_dict, read_yaml
    from llama_moe.merging.pipeline import merge

    config = config_from_dict(read_yaml(ROOT / "recipes" / "btx" / "merge.yaml"))
    prompted = tuple(
        dataclasses.replace(expert, positive_prompts=tuple(PROMPTS[domain]), data=None)
        for expert, domain in zip(config.experts, DOMAINS, strict=True)
    )
    merges = {
        "merged": config,
        "merged-uncentred": dataclasses.replace(config, gate_options={"expert_data_center": False}),
        "merged-prompts": dataclasses.replace(config, experts=prompted, gate_mode="hidden"),
    }
    seconds = {}
    for name, merge_config in merges.items():
        start = time.perf_counter()
        merge(merge_config, RunOptions(output=str(OUT / name), overwrite=True, eval=False, progress=False))
        seconds[name] = round(time.perf_counter() - start, 1)
        print(f"{name}: {seconds[name]} s", flush=True)
    MERGE_TIMES.write_text(json.dumps(seconds) + "\n")


def texts(tokenizer, max_tokens: int) -> dict:
    """The first `max_tokens` tokens of each domain's test file and of the general text."""
    from llama_moe.text.documents import iter_documents
    from llama_moe.text.tokens import token_stream

    paths = {d: ROOT / "data" / "offline" / "pretrain" / d / "test.jsonl" for d in DOMAINS}
    streams = {name: token_stream(iter_documents(str(path)), tokenizer, max_tokens) for name, path in paths.items()}
    return streams | {"general": token_stream([GENERAL.read_text()], tokenizer, max_tokens)}


def stage_cost(folder: Path | None, stage: str) -> tuple[int, float | None]:
    """(training tokens, seconds) of the stage that made `folder`: a recipe's from its history and log (training
    time, model loading excluded), a merge's from `merge_stage`."""
    if stage in ("branch", "mix"):
        tokens = json.loads((folder / "training_history.json").read_text())[-1]["tokens"]
        log = json.loads((folder / "trainer_log.json").read_text())
        return tokens, round(next(e["train_runtime"] for e in log if "train_runtime" in e), 1)
    if stage == "merge":
        return 0, json.loads(MERGE_TIMES.read_text())[folder.name]
    return 0, None


def evaluate_stage(max_tokens: int, only: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from llama_moe.checkpoints.folder import read_tokenizer
    from llama_moe.loading import DEFAULT_MODEL, model_folder

    dense = model_folder(DEFAULT_MODEL)
    tokens = texts(read_tokenizer(str(dense)), max_tokens)
    for name, (folder, stage) in MODELS.items():
        if only and not any(word in name for word in only):
            continue
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder or dense, dtype=torch.float32).eval()
        result = {text: round(value, 3) for text, value in perplexities(model, tokens, batch_size=4).items()}
        result["mixture"] = round(math.exp(sum(math.log(result[d]) for d in DOMAINS) / len(DOMAINS)), 3)
        train_tokens, seconds = stage_cost(folder, stage)
        row = {"table": "btx", "model": name, "stage": stage, "train_tokens": train_tokens}
        row |= {"stage_seconds": seconds, "eval_tokens": max_tokens, "perplexity": result}
        record("btx", row)
        print(name, result, f"eval {time.perf_counter() - start:.0f} s", flush=True)
        del model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["merge", "eval"])
    parser.add_argument("--only", nargs="+", help="eval: only the rows whose names contain one of these words")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of each text scored (256-token windows)")
    args = parser.parse_args(argv)
    if args.stage == "merge":
        merge_stage()
    else:
        evaluate_stage(args.tokens, args.only)


if __name__ == "__main__":
    main()

"""Converted folders exported to the stock transformers families, run by transformers' own classes: logits and greedy
tokens against the converted model (the check vLLM and SGLang rely on: they load these families).

    python benchmarks/quality/export_transformers.py outputs/presets/sparse-25 outputs/presets/sparse-50 \
        outputs/presets/sparse-75

Each folder goes to every target of `llama-moe export` that takes it (`qwen2_moe`; `mixtral` where there is no shared
expert; the others are refused in one line and reported so), into a temporary folder, in float32. The exported model
is loaded with `AutoModelForCausalLM` (no remote code), and compared on the first 64 tokens of the licences
(`benchmarks/common.py`: text of another domain than the calibration data) and on 32 greedy tokens of a chat prompt.
Rows go to benchmarks/results/export.jsonl. Not part of CI (the tests export tiny models).
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`
from benchmarks.common import heldout_tokens, record
from benchmarks.quality.export_llama_cpp import chat_prompt
from llama_moe.export import export_model

TARGETS = ("qwen2_moe", "mixtral")


def outputs(model, ids: torch.Tensor, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """(logits `[S, V]` on `ids`, greedy continuation of `prompt`)."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
        generated = model.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False)
    return logits, generated[0, len(prompt) :].tolist()


def check(folder: Path, target: str, reference: tuple, ids, prompt, new_tokens: int) -> dict:
    """The row of `folder` exported to `target`: refused (the reason) or its differences from `reference`."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            export_model(folder, target, Path(tmp) / "out", dtype="float32", progress=False)
        except ValueError as refusal:
            return {"model": str(folder), "target": target, "refused": str(refusal)}
        exported = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out", dtype=torch.float32).eval()
        logits, tokens = outputs(exported, ids, prompt, new_tokens)
    difference = (logits - reference[0]).abs().max().item()
    return {
        "model": str(folder),
        "target": target,
        "class": type(exported).__name__,
        "max_logit_difference": difference,
        "logit_scale": reference[0].abs().max().item(),
        "same_greedy_tokens": tokens == reference[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    for folder in args.folders:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = heldout_tokens(tokenizer, args.tokens, ("licences",))["licences"]
        prompt = torch.tensor(chat_prompt(tokenizer)[1])
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        reference = outputs(model, ids, prompt, args.new_tokens)
        for target in TARGETS:
            row = check(folder, target, reference, ids, prompt, args.new_tokens)
            print(row, flush=True)
            record("export", row)


if __name__ == "__main__":
    main()

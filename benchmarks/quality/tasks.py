"""Accuracy beyond perplexity: the package's local lm-eval task (`llama_moe_arithmetic`) and a multiple-choice set
written here from text that ships offline, for the dense model and converted folders, as shares of the dense
model's accuracy.

The set (`offline_continuation`, written to data/tasks/): each item a passage of 48 words and four candidate next 12
words, the true ones and three from other documents of the same kind, scored by lm-eval's log-likelihood (`acc`, and
`acc_norm` by length). 150 passages come from the standard library's docstrings (the calibration corpus's domain),
one from each section-1 manual page long enough among those the held-out `manpages` text does not use (pages 75, 225,
... of /usr/share/man/man1, where the held-out text takes 0, 150, ...): 268 items on this machine kind.
Deterministic (seed 0).

    python benchmarks/quality/tasks.py outputs/presets/sparse-25 outputs/presets/sparse-75
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import RESULTS, ROOT, record, recorded_calibration

TASKS = ROOT / "data" / "tasks"
CONTEXT_WORDS, ANSWER_WORDS, ITEMS_PER_KIND = 48, 12, 150


def manual_pages() -> list[str]:
    """The section-1 pages halfway between the held-out text's (`make_heldout.py` takes every MAN_STRIDE-th)."""
    from benchmarks.quality.make_heldout import MAN1, MAN_STRIDE, render_man_page

    return [render_man_page(page) for page in sorted(MAN1.glob("*.1.gz"))[MAN_STRIDE // 2 :: MAN_STRIDE]]


def passages(texts: list[str]) -> list[list[str]]:
    """Word lists long enough for a passage and its answer, from the middle of each text (headers skipped)."""
    words = [text.split() for text in texts]
    return [w[10 : 10 + CONTEXT_WORDS + ANSWER_WORDS] for w in words if len(w) >= 10 + CONTEXT_WORDS + ANSWER_WORDS]


def items(kind: str, texts: list[str], rng: random.Random) -> list[dict]:
    spans = passages(texts)
    rng.shuffle(spans)
    chosen = []
    for index, span in enumerate(spans[:ITEMS_PER_KIND]):
        others = [s for j, s in enumerate(spans) if j != index]
        wrong = [" ".join(s[CONTEXT_WORDS:]) for s in rng.sample(others, 3)]
        choices = [" ".join(span[CONTEXT_WORDS:]), *wrong]
        rng.shuffle(choices)
        answer = choices.index(" ".join(span[CONTEXT_WORDS:]))
        chosen.append({"kind": kind, "context": " ".join(span[:CONTEXT_WORDS]), "choices": choices, "answer": answer})
    return chosen


def write_task() -> dict:
    """The lm-eval task config of the set (written with its data under data/tasks/ the first time)."""
    data = TASKS / "offline_continuation.jsonl"
    if not data.is_file():
        from llama_moe.text.corpus import stdlib_docstrings

        rng = random.Random(0)
        rows = items("docstrings", stdlib_docstrings(), rng) + items("manpages", manual_pages(), rng)
        TASKS.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "task": "offline_continuation",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "answer",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }


def accuracies(folder: str, tasks: list) -> tuple[dict, str | None]:
    """Each task's accuracies, and the calibration text the folder's conversion recorded (None for dense)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from llama_moe.loading import load_model

    model, tokenizer, _ = load_model(folder, dtype="float32", device="cpu")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=16, backend="causal")
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, log_samples=False)["results"]
    scores = {task: {m.split(",")[0]: v for m, v in r.items() if m.startswith("acc")} for task, r in results.items()}
    return scores, recorded_calibration(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="converted folders (the dense model is scored first)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    from llama_moe.evaluation.harness import local_tasks

    torch.set_num_threads(args.threads)
    tasks = [write_task(), *local_tasks().values()]
    dense, _ = accuracies("default", tasks)
    print("dense", json.dumps(dense), flush=True)
    for folder in args.models:
        scores, calibration = accuracies(folder, tasks)
        share = {task: round(scores[task]["acc"] / dense[task]["acc"], 3) for task in scores}
        row = {"kind": "tasks", "preset": Path(folder).name, "accuracy": scores, "dense": dense, "share": share}
        row["calibration"] = calibration
        print(json.dumps(row), flush=True)
        record("presets", row, RESULTS / "presets.jsonl")


if __name__ == "__main__":
    main()

"""Recovery plot: held-out perplexity per domain against tokens seen during continual pre-training, next to the dense
model's on the same held-out blocks (docs/training.md). One run, or several from the same start compared (LM loss
against distillation, benchmarks/reports/recovery-at-25.md):

    python benchmarks/quality/recovery.py --trained outputs/smollm2-moe-cpt
    python benchmarks/quality/recovery.py --trained lm=outputs/r25-lm distill=outputs/r25-distill \
        heal+distill=outputs/r25-heal-distill --output docs/images/recovery_25.png

Reads each trained folder's `trainer_log.json` (its evaluations; train with `--eval_on_start true` to have the
training-free conversion at 0 tokens) and `training_history.json` (tokens per step, block length, blocks
evaluated), or for a run stopped early its newest `checkpoint-N` folder (`trainer_state.json`, `run_shape.json`);
scores the dense built-in model (or --dense) on the same held-out blocks, rebuilt from the recipe's held-out files
(--recipe). Writes the plot and a JSON file beside it (default: `recovery.png` and `recovery.json` in the first
trained folder) and prints, per run and domain, the perplexity as a ratio to the dense model's and the first
evaluated token count where it is within 2x and 1.5x of it.
"""

import argparse
import json
import math
from pathlib import Path

import torch


def held_out_blocks(recipe: Path, tokenizer, seq_len: int, eval_blocks: int) -> dict[str, torch.Tensor]:
    """The first `eval_blocks` held-out blocks per domain, as the recipe's training evaluated them."""
    import yaml

    from llama_moe.training.pretrain import ContinualPretrainArguments, load_domains

    config = yaml.safe_load(recipe.read_text())
    fields = {k: config[k] for k in ("domains", "held_out", "held_out_fraction", "text_column") if k in config}
    args = ContinualPretrainArguments(model_name_or_path="", seq_len=seq_len, **fields)
    return {domain.name: domain.held_out[:eval_blocks] for domain in load_domains(args, tokenizer)}


def run_curves(trained: Path, seq_len: int | None = None) -> tuple[dict | None, dict]:
    """(the last stage's record, {domain: [(tokens, perplexity), ...]}) from a trained folder's logs, or from a
    `checkpoint-N` folder of a run that was stopped (its trainer state holds the log; `seq_len` sets its tokens per
    step). The final evaluation repeats the last scheduled one at the same step: one point per step."""
    if (trained / "training_history.json").is_file():
        (stage,) = json.loads((trained / "training_history.json").read_text())[-1:]
        tokens_per_step = stage["tokens"] / stage["steps"]
        log = json.loads((trained / "trainer_log.json").read_text())
    else:
        stage, log = None, json.loads((trained / "trainer_state.json").read_text())["log_history"]
        shape = json.loads((trained / "run_shape.json").read_text())
        tokens_per_step = seq_len * shape["world_size"] * shape["per_device_train_batch_size"]
        tokens_per_step *= shape["gradient_accumulation_steps"]
    names = sorted({key[5:-5] for entry in log for key in entry if key.startswith("eval_") and key.endswith("_loss")})
    curves = {}
    for name in names:
        points = {e["step"]: math.exp(e[f"eval_{name}_loss"]) for e in log if f"eval_{name}_loss" in e}
        curves[name] = [(step * tokens_per_step, perplexity) for step, perplexity in sorted(points.items())]
    return stage, curves


def reached(points: list, dense: float, ratio: float) -> float | None:
    """The first evaluated token count with perplexity within `ratio` x dense (None: never)."""
    return next((tokens for tokens, perplexity in points if perplexity <= ratio * dense), None)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trained", required=True, nargs="+", help="FOLDER, or NAME=FOLDER per run")
    parser.add_argument("--recipe", default="recipes/pretrain/llama-moe-v1.yaml")
    parser.add_argument("--dense", default=None, help="dense model folder (default: the built-in model)")
    parser.add_argument("--output", default=None, help="plot path (default: recovery.png in the one trained folder)")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llama_moe.checkpoints import default_model_path
    from llama_moe.training.sampling import domain_losses

    runs = dict(spec.partition("=")[::2] if "=" in spec else (Path(spec).name, spec) for spec in args.trained)
    finished = [Path(f) for f in runs.values() if (Path(f) / "training_history.json").is_file()]
    if not finished:
        raise SystemExit("error: give at least one finished run (a folder with training_history.json).")
    (stage,) = json.loads((finished[0] / "training_history.json").read_text())[-1:]
    recorded = {name: run_curves(Path(folder), stage["seq_len"]) for name, folder in runs.items()}
    dense_path = args.dense or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(dense_path)
    blocks = held_out_blocks(Path(args.recipe), tokenizer, stage["seq_len"], stage["eval_blocks"])
    dense = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32)
    dense_ppl = {n: math.exp(v) for n, v in zip(blocks, domain_losses(dense, list(blocks.values())).tolist())}

    output = Path(args.output) if args.output else Path(next(iter(runs.values()))) / "recovery.png"
    result = {"dense_perplexity": dense_ppl, "runs": {name: curves for name, (_, curves) in recorded.items()}}
    output.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot({name: curves for name, (_, curves) in recorded.items()}, dense_ppl, output)
    for run, (_, curves) in recorded.items():
        for name, points in curves.items():
            (_, first), (tokens, last) = points[0], points[-1]
            marks = {r: reached(points, dense_ppl[name], r) for r in (2.0, 1.5)}
            when = ", ".join(f"{r}x at {t:,.0f}" if t is not None else f"{r}x not reached" for r, t in marks.items())
            ratios = f"{first / dense_ppl[name]:.2f}x -> {last / dense_ppl[name]:.2f}x"
            summary = f"{run} {name}: {first:.1f} -> {last:.1f} after {tokens:,.0f} tokens, dense {dense_ppl[name]:.1f}"
            print(f"{summary}: {ratios}; {when}")


def plot(runs: dict, dense: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(dense), figsize=(4 * len(dense), 3.4))
    for axis, name in zip(axes, dense):
        for run, curves in runs.items():
            points = curves[name]
            label = run if len(runs) > 1 else "MoE: training-free at 0, then continual pre-training"
            axis.plot([t / 1000 for t, _ in points], [p for _, p in points], marker="o", markersize=3, label=label)
        axis.axhline(dense[name], color="black", linestyle="--", label="dense model")
        axis.set_yscale("log")
        axis.set_title(f"{name}: held-out perplexity", fontsize=9)
        axis.set_xlabel("training tokens (thousands)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

"""Recovery plot: held-out perplexity per domain against tokens seen during continual pre-training, next to the dense
model's on the same held-out blocks (docs/training.md).

    python benchmarks/recovery.py --trained outputs/smollm2-moe-cpt

Reads the trained folder's `trainer_log.json` (its evaluations; train with `--eval_on_start true` to have the
training-free conversion at 0 tokens) and `training_history.json` (tokens per step, block length, blocks
evaluated); scores the dense built-in model (or --dense) on the same held-out blocks, rebuilt from the recipe's
held-out files (--recipe). Writes `recovery.png` and `recovery.json` into
--trained.
"""

import argparse
import json
import math
from pathlib import Path

import torch


def held_out_blocks(recipe: Path, tokenizer, seq_len: int, eval_blocks: int) -> dict[str, torch.Tensor]:
    """The first `eval_blocks` held-out blocks per domain, as the recipe's training evaluated them."""
    import yaml

    from llama_moe_hf.training.pretrain import ContinualPretrainArguments, load_domains

    config = yaml.safe_load(recipe.read_text())
    fields = {k: config[k] for k in ("domains", "held_out", "held_out_fraction", "text_column") if k in config}
    args = ContinualPretrainArguments(model_name_or_path="", seq_len=seq_len, **fields)
    return {domain.name: domain.held_out[:eval_blocks] for domain in load_domains(args, tokenizer)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trained", required=True)
    parser.add_argument("--recipe", default="recipes/pretrain/llama-moe-v1.yaml")
    parser.add_argument("--dense", default=None, help="dense model folder (default: the built-in model)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the training's")
    parser.add_argument("--eval-blocks", type=int, default=None, help="default: the training's")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llama_moe_hf.conversion.sources import default_model_path
    from llama_moe_hf.training.sampling import domain_losses

    trained = Path(args.trained)
    (stage,) = json.loads((trained / "training_history.json").read_text())[-1:]
    tokens_per_step = stage["tokens"] / stage["steps"]
    log = json.loads((trained / "trainer_log.json").read_text())
    dense_path = args.dense or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(dense_path)
    seq_len, eval_blocks = args.seq_len or stage["seq_len"], args.eval_blocks or stage["eval_blocks"]
    blocks = held_out_blocks(Path(args.recipe), tokenizer, seq_len, eval_blocks)
    dense = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32)
    dense_loss = dict(zip(blocks, domain_losses(dense, list(blocks.values())).tolist()))

    curves = {}  # the final evaluation repeats the last scheduled one at the same step: one point per step
    for name in blocks:
        points = {e["step"]: math.exp(e[f"eval_{name}_loss"]) for e in log if f"eval_{name}_loss" in e}
        curves[name] = [(step * tokens_per_step, perplexity) for step, perplexity in sorted(points.items())]
    result = {"dense_perplexity": {n: math.exp(v) for n, v in dense_loss.items()}, "curves": curves}
    (trained / "recovery.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(curves, result["dense_perplexity"], trained / "recovery.png")
    for name, points in curves.items():
        (_, first), (tokens, last) = points[0], points[-1]
        dense_ppl = result["dense_perplexity"][name]
        print(f"{name}: {first:.1f} -> {last:.1f} after {tokens:,.0f} tokens (dense {dense_ppl:.1f})")


def plot(curves: dict, dense: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.4))
    for axis, (name, points) in zip(axes, curves.items()):
        label = "MoE: training-free at 0, then continual pre-training"
        axis.plot([t / 1000 for t, _ in points], [p for _, p in points], marker="o", label=label)
        axis.axhline(dense[name], color="black", linestyle="--", label="dense model (= the upcycled MoE)")
        axis.set_yscale("log")
        axis.set_title(f"{name}: held-out perplexity", fontsize=9)
        axis.set_xlabel("training tokens (thousands)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

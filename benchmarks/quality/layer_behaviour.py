"""Which layers hold what a conversion loses of the dense model's behaviour, and whether the losses add up or compound.

For a converted folder, the dense model with the folder's MoE block in place of one layer's MLP (every other layer
dense), layer by layer; then the first k layers converted together against the sum of their single-layer figures.
Each model is scored by the KL over the dense model's own answers (teacher-forced, `behaviour.answer_kl`) and on
held-out text (`behaviour.text_scores`): every third `choose` prompt and 8 rows of the man pages, as settings are
chosen on (about 20 s a model on 2 threads: 36 models). One row per folder in
benchmarks/results/layer_behaviour.jsonl.

    python benchmarks/quality/layer_behaviour.py outputs/exp/s50-chatmix-kl1
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import record
from benchmarks.quality.behaviour import SETS, rows
from llama_moe import behaviour
from llama_moe.loading import load_model
from llama_moe.text.prompts import prompts

PREFIX_STEP = 5  # the first 5, 10, ... layers converted together


def figures(model, reference, text: str) -> dict:
    return {
        "answer_kl": behaviour.answer_kl(model, reference),
        "text_kl": behaviour.text_scores(model, reference)[text]["kl"],
    }


def with_layers(dense, moe, layers) -> list:
    """Put `moe`'s MLPs of `layers` into `dense` (in place); returns the dense MLPs to put back."""
    kept = [dense.model.layers[i].mlp for i in layers]
    for i in layers:
        dense.model.layers[i].mlp = moe.model.layers[i].mlp
    return kept


def restore(dense, layers, kept) -> None:
    for i, mlp in zip(layers, kept):
        dense.model.layers[i].mlp = mlp


def scored(dense, moe, layers, reference, text) -> dict:
    kept = with_layers(dense, moe, layers)
    try:
        return figures(dense, reference, text)
    finally:
        restore(dense, layers, kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a converted LlamaMoE folder of the default model")
    parser.add_argument("--every", type=int, default=3, help="score every N-th prompt (36 models are scored)")
    parser.add_argument("--rows", type=int, default=8, help="rows of 256 tokens of the held-out text")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    split, (text,) = SETS["choose"]
    dense, tokenizer, _ = load_model("default", dtype="float32", device="cpu")
    moe = load_model(args.folder, dtype="float32", device="cpu")[0].eval()
    texts = {name: ids[: args.rows] for name, ids in rows(tokenizer, (text,)).items()}
    reference = behaviour.dense_reference(dense, tokenizer, prompts(split)[:: args.every], texts)
    layers = list(moe.config.moe_layers)
    start = time.perf_counter()
    single = {}
    for i in layers:
        single[i] = scored(dense, moe, [i], reference, text)
        print(
            f"layer {i:2d} alone: answer KL {single[i]['answer_kl']:.4f}, {text} KL {single[i]['text_kl']:.4f}",
            flush=True,
        )
    prefixes = {}
    for k in [*range(PREFIX_STEP, len(layers), PREFIX_STEP), len(layers)]:
        together = scored(dense, moe, layers[:k], reference, text)
        summed = {key: sum(single[i][key] for i in layers[:k]) for key in together}
        prefixes[k] = {"together": together, "sum_of_single": summed}
        print(
            f"first {k:2d} layers together: answer KL {together['answer_kl']:.4f} (sum of single {summed['answer_kl']:.4f}), "
            f"{text} KL {together['text_kl']:.4f} (sum {summed['text_kl']:.4f})",
            flush=True,
        )
    whole = figures(moe, reference, text)  # the folder itself: its own attention and norms too (trained jointly)
    print(
        f"the folder: answer KL {whole['answer_kl']:.4f}, {text} KL {whole['text_kl']:.4f} [{time.perf_counter() - start:.0f} s]"
    )
    record(
        "layer_behaviour",
        {"model": args.folder, "set": "choose", "single": single, "prefixes": prefixes, "folder": whole},
    )


if __name__ == "__main__":
    main()

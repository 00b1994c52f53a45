"""Which FFN rows should `--method cluster` cluster: gate_proj, up_proj or both? (docs/construction.md)

On SmolLM2-135M-Instruct, every layer is split into 8 experts by balanced k-means on the L2-normalised rows of
gate_proj, up_proj or both (concatenated), plus the random split for reference. All splits get the same oracle-free
router rule: router row e = mean of expert e's gate_proj rows (the expert's mean gate pre-activation), scaled by 1e-4 so
the top-k choice follows that ranking while the k weights stay uniform, and the output scale is N (each selected expert
counts N/k, which keeps the dense magnitude); no choice is favoured by calibration data. Perplexity is measured on
held-out text: the last 10% of the built-in corpus documents, in 256-token chunks.

    python benchmarks/quality/cluster_projection.py --chunks 8 --top-k 6 7 8
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import chunk_perplexity
from llama_moe.checkpoints import default_model_path
from llama_moe.conversion.calibration import CalibrationContext, tokenize_calibration
from llama_moe.conversion.plan import ConversionPlan
from llama_moe.text.documents import load_texts
from llama_moe_hf import MoERecipe, build_moe

SPLITS = {
    "random": {"method": "random"},
    "gate": {"method": "cluster", "cluster_on": "gate"},
    "up": {"method": "cluster", "cluster_on": "up"},
    "both": {"method": "cluster", "cluster_on": "both"},
}


def split_seconds(dense, recipe: MoERecipe) -> float:
    """Time to split every layer's FFN as `build_moe(dense, recipe)` does, the split alone (no model is built)."""
    plan = ConversionPlan.create(recipe, dense.config)
    context = CalibrationContext(plan.recipe, lambda *_: dense)
    plan.prepare(context)  # splits of weight rows ask it for nothing: no calibration pass
    method, _ = plan.components["mlp"]
    start = time.perf_counter()
    for i in plan.targets["mlp"].layers:
        method.split(i, dense.model.layers[i].mlp.state_dict(), context)
    return time.perf_counter() - start


@torch.no_grad()
def install_mean_gate_routers(model) -> None:
    """Router row e = 1e-4 x the mean of expert e's gate rows: tiny, so the weights of the k chosen experts stay
    uniform."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        layer.mlp.gate.weight.copy_(1e-4 * experts.gate_up_proj[:, : experts.intermediate_dim].mean(dim=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=16, help="held-out 256-token chunks")
    parser.add_argument("--top-k", type=int, nargs="+", default=[6, 7])
    parser.add_argument("--num-experts", type=int, default=8)
    args = parser.parse_args()

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts, description = load_texts(None)
    held_out = texts[int(0.9 * len(texts)) :]
    chunks = tokenize_calibration(held_out, tokenizer, args.chunks * 256, 256)
    print(f"held-out text: last 10% of {description}, {chunks.shape[0]} chunks of 256 tokens")
    print(f"dense: ppl {chunk_perplexity(model, chunks):.2f}")

    for name, fields in SPLITS.items():
        recipe = MoERecipe.from_dict(
            {
                **fields,
                "num_experts": args.num_experts,
                "top_k": max(args.top_k),  # each measurement sets its own top-k
                "router_init": "zero",  # replaced by the mean-gate-row rule
                # Output scale N: each of the k chosen experts (weight 1/k) counts N/k, which keeps the dense magnitude.
                "score_scale_factor": float(args.num_experts),
            }
        )
        seconds = split_seconds(model, recipe)
        moe = build_moe(model, recipe)
        install_mean_gate_routers(moe)
        results = []
        for top_k in args.top_k:
            for layer in moe.model.layers:
                layer.mlp.gate.top_k = top_k
            results.append(f"top-{top_k} ppl {chunk_perplexity(moe, chunks):.2f}")
        print(f"{name}: split {seconds:.1f} s for {len(moe.model.layers)} layers; " + ", ".join(results), flush=True)


if __name__ == "__main__":
    main()

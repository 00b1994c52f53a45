"""How well G-MoEfication's expert selector learns to rank experts, per training objective and amount of data.

SmolLM2-135M-Instruct, cluster split (balanced k-means on gate rows, 8 experts), compensation on. For each layer in
`--layers`, the MLP inputs of `--calibration-tokens` tokens of the built-in corpus are split 75/25 into training and
held-out tokens; a selector is trained on (the first n of) the training tokens and scored on the held-out ones by the
*dropped-energy ratio* at top-k: the deviation energy of the experts it drops / that of the experts the oracle drops
(1.0 = oracle; lower is better). This is the per-layer quantity behind the perplexity gap to the oracle in
benchmarks/reports/gmoefication.md. Objectives:

    bce-adam       the first selector objective: binary cross-entropy against energy / the token's largest,
                   full-batch Adam (lr 1e-2, --adam-steps steps)
    bce-lbfgs      gmoefication.train_selector(objective="bce"): the same loss, L-BFGS, 100 iterations
    listwise-lbfgs gmoefication.train_selector (default objective): listwise cross-entropy, L-BFGS, 100 iterations

    # benchmarks/reports/gmoefication.md:
    python benchmarks/quality/selector_training.py --threads 1 --objectives bce-adam listwise-lbfgs
    python benchmarks/quality/selector_training.py --train-tokens 12288 --objectives bce-lbfgs listwise-lbfgs
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llama_moe.checkpoints import default_model_path
from llama_moe.conversion.calibration import tokenize_calibration
from llama_moe.conversion.experts import build_expert_tensors
from llama_moe.conversion.methods.cluster.clustering import split_cluster
from llama_moe.conversion.routers.selector import gmoefication as g
from llama_moe.conversion.statistics import collect_calibration
from llama_moe.text.corpus import stdlib_docstrings

TOP_K = (2, 4, 6, 7)
OBJECTIVES = ("bce-adam", "bce-lbfgs", "listwise-lbfgs")


def dropped_energy_ratio(scores: torch.Tensor, energy: torch.Tensor, top_k: int) -> float:
    """Energy of the experts `scores` drops at top-k / energy of the experts the oracle drops."""
    kept = energy.gather(1, scores.topk(top_k, dim=-1).indices).sum()
    oracle_kept = energy.topk(top_k, dim=-1).values.sum()
    return ((energy.sum() - kept) / (energy.sum() - oracle_kept)).item()


def train_bce_adam(hidden: torch.Tensor, energy: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        router = g._selector_router(hidden.shape[1], energy.shape[1])
    optimizer = torch.optim.Adam(router.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        g.selector_loss(router(hidden)[0], energy, objective="bce").backward()
        optimizer.step()
    return router.state_dict()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration-tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 10, 20, 29])
    parser.add_argument("--train-tokens", type=int, nargs="+", default=[2048, 4096, 12288])
    parser.add_argument("--adam-steps", type=int, default=1000)
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = default_model_path()
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = stdlib_docstrings()
    input_ids = tokenize_calibration(
        texts[: int(0.9 * len(texts))], AutoTokenizer.from_pretrained(path), args.calibration_tokens, 256
    )
    stats = collect_calibration(dense, input_ids, args.layers, max_hidden_samples=args.calibration_tokens).mlp

    results = {}  # (objective, n) -> {k: [ratio per layer]}
    for layer in args.layers:
        mlp = dense.model.layers[layer].mlp
        weights = (mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach())
        split = split_cluster(weights[0], weights[1], 8, cluster_on="gate")
        tensors = build_expert_tensors(*weights, split)
        hidden = stats[layer].hidden_states
        energy = g.deviation_energy(
            hidden,
            tensors["experts.gate_up_proj"],
            tensors["experts.down_proj"],
            stats[layer].mean_activation[split.expert_neurons],
        )
        num_train = int(0.75 * hidden.shape[0])
        held_hidden, held_energy = hidden[num_train:], energy[num_train:]
        for n in args.train_tokens:
            n = min(n, num_train)
            for objective in args.objectives:
                started = time.time()
                if objective == "bce-adam":
                    state = train_bce_adam(hidden[:n], energy[:n], args.adam_steps)
                else:
                    state = g.train_selector(hidden[:n], energy[:n], 8, objective=objective.split("-")[0])
                scores = g.selector_scores(state, held_hidden)
                ratios = results.setdefault((objective, n), {k: [] for k in TOP_K})
                for k in TOP_K:
                    ratios[k].append(dropped_energy_ratio(scores, held_energy, k))
                print(f"layer {layer} {objective} n={n}: {time.time() - started:.1f} s", flush=True)

    print(f"\nDropped-energy ratio on {held_hidden.shape[0]} held-out tokens, mean over layers {args.layers}:\n")
    print("| objective | training tokens | " + " | ".join(f"top-{k}" for k in TOP_K) + " |")
    print("|---|---|" + "---|" * len(TOP_K))
    for (objective, n), ratios in results.items():
        cells = " | ".join(f"{sum(ratios[k]) / len(ratios[k]):.3f}" for k in TOP_K)
        print(f"| {objective} | {n} | {cells} |")


if __name__ == "__main__":
    main()

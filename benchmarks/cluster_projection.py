"""Which FFN rows should `--method cluster` cluster: gate_proj, up_proj or both? (docs/construction.md)

On SmolLM2-135M-Instruct, every layer is split into 8 experts by balanced k-means on the L2-normalised rows of
gate_proj, up_proj or both (concatenated), plus the random split for reference. All splits get the same oracle-free
router rule: router row e = mean of expert e's gate_proj rows (the expert's mean gate pre-activation), scaled by 1e-4 so
the top-k choice follows that ranking while the k weights stay uniform, and the output scale is N (each selected expert
counts N/k, which keeps the dense magnitude); no choice is favoured by calibration data. Perplexity is measured on
held-out text: the last 10% of the built-in corpus documents, in 256-token chunks.

    python benchmarks/cluster_projection.py --chunks 8 --top-k 6 7 8
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llama_moe_hf.conversion.calibration import load_calibration_texts, tokenize_calibration
from llama_moe_hf.conversion.construction import split_cluster
from llama_moe_hf.conversion.convert import dense_config_fields
from llama_moe_hf.conversion.default_model import default_model_path
from llama_moe_hf.conversion.experts import build_expert_tensors, split_random
from llama_moe_hf.modeling import LlamaMoEConfig
from llama_moe_hf.modeling.modeling_llama_moe import LlamaMoESparseMoeBlock
from quality import perplexity  # same folder: the one perplexity of the quality benchmarks


def swap_in_moe(model, splits, top_k: int) -> list:
    """Replace each dense MLP by the MoE block of its split (in place); returns the dense MLPs to put back."""
    dense = dense_config_fields(model.config)
    num_experts = next(iter(splits.values())).num_experts
    config = LlamaMoEConfig(
        **dense, num_experts=num_experts, num_experts_per_tok=top_k, score_scale_factor=float(num_experts)
    )
    originals = []
    for i, split in splits.items():
        layer = model.model.layers[i]
        mlp = layer.mlp
        tensors = build_expert_tensors(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, split)
        # [E, H]: mean gate row of each expert, tiny so the weights of the k chosen experts stay uniform
        tensors["gate.weight"] = 1e-4 * tensors["experts.gate_up_proj"][:, : split.expert_size].mean(dim=1)
        block = LlamaMoESparseMoeBlock(config, i)
        block.load_state_dict(tensors)
        originals.append(mlp)
        layer.mlp = block
    return originals


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=16, help="held-out 256-token chunks")
    parser.add_argument("--top-k", type=int, nargs="+", default=[6, 7])
    parser.add_argument("--num-experts", type=int, default=8)
    args = parser.parse_args()

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts, description = load_calibration_texts(None)
    held_out = texts[int(0.9 * len(texts)) :]
    chunks = tokenize_calibration(held_out, tokenizer, args.chunks * 256, 256)
    print(f"held-out text: last 10% of {description}, {chunks.shape[0]} chunks of 256 tokens")
    print(f"dense: ppl {perplexity(model, chunks):.2f}")

    layers = range(model.config.num_hidden_layers)
    for name in ["random", "gate", "up", "both"]:
        start = time.perf_counter()
        splits = {}
        for i in layers:
            mlp = model.model.layers[i].mlp
            if name == "random":
                splits[i] = split_random(mlp.down_proj.in_features, args.num_experts, seed=i)
            else:
                splits[i] = split_cluster(mlp.gate_proj.weight, mlp.up_proj.weight, args.num_experts, cluster_on=name)
        seconds = time.perf_counter() - start
        results = []
        for top_k in args.top_k:
            originals = swap_in_moe(model, splits, top_k)
            results.append(f"top-{top_k} ppl {perplexity(model, chunks):.2f}")
            for i, mlp in zip(layers, originals):
                model.model.layers[i].mlp = mlp
        print(f"{name}: split {seconds:.1f} s for {len(layers)} layers; " + ", ".join(results), flush=True)


if __name__ == "__main__":
    main()

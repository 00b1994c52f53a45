"""Held-out perplexity of SmolLM2-135M-Instruct converted to AttnMoE (no training), next to the dense model.

    python benchmarks/quality_attn_moe.py [--chunks 32] [--seq-len 256] [--calibration-chunks 16] [--threads N]

Text: the built-in corpus (Python stdlib docstrings); the last 10% of the documents are held out, the fitted
routers are calibrated on the first 90%. Attention experts keep `attention_score_scale_factor = k`, so with a
near-uniform router the kept heads have weight ~1, as in the dense model. Routers:

    random  normal(0, 0.02): near-uniform weights, an essentially random choice of experts per token
    fit     `fit_attention_routers`: ridge regression of each expert's output norm on the attention input
    oracle  top-k experts by their actual output norm (computed densely per token): a reference, not a model
"""

import argparse
import time

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaAttention

from llama_moe_hf.conversion.attention import attn_moe_from_dense, expert_output_norms, fit_attention_routers
from llama_moe_hf.conversion.calibration import tokenize_calibration
from llama_moe_hf.conversion.corpus import stdlib_docstrings
from llama_moe_hf.conversion.default_model import default_model_path
from llama_moe_hf.conversion.experts import split_random
from llama_moe_hf.modeling.modeling_attn_moe import AttnMoEAttention
from quality import perplexity  # same folder: the one perplexity of the quality benchmarks


class OracleRouter(nn.Module):
    """Stands in for an attention router: top-k experts by output norm, equal weights 1/k."""

    def __init__(self, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.norms = None  # [T, E], set by `install_oracle`'s pre-hook before each attention forward

    def forward(self, hidden_states):
        index = self.norms.topk(self.top_k, dim=-1).indices
        return self.norms, torch.full(index.shape, 1.0 / self.top_k), index


def install_oracle(model, top_k: int) -> None:
    for layer in model.model.layers:
        attention = layer.self_attn
        if not isinstance(attention, AttnMoEAttention):
            continue
        attention.gate = OracleRouter(top_k)

        def pre_hook(module, args, kwargs):
            captured = {}
            handle = module.o_proj.register_forward_pre_hook(lambda m, a: captured.update(heads=a[0]))
            dense_kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"}
            LlamaAttention.forward(module, **dense_kwargs)  # the dense heads, no routing, no cache update
            handle.remove()
            heads = captured["heads"].reshape(-1, captured["heads"].shape[-1])
            module.gate.norms = expert_output_norms(heads, module.o_proj.weight, module.num_experts)

        attention.register_forward_pre_hook(pre_hook, with_kwargs=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--calibration-chunks", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    path = default_model_path()
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    docs = stdlib_docstrings()
    cut = int(len(docs) * 0.9)
    held_out = tokenize_calibration(docs[cut:], tokenizer, args.chunks * args.seq_len, args.seq_len)
    calibration = tokenize_calibration(docs[:cut], tokenizer, args.calibration_chunks * args.seq_len, args.seq_len)
    print(f"held-out: {held_out.shape[0]} x {held_out.shape[1]} tokens from {len(docs) - cut} docs; "
          f"calibration: {calibration.shape[0]} x {calibration.shape[1]} tokens")

    rows = []

    def report(name, model):
        start = time.perf_counter()
        value = perplexity(model, held_out, batch_size=8)
        rows.append((name, value))
        print(f"| {name} | {value:.2f} |  ({time.perf_counter() - start:.0f} s)", flush=True)

    report("dense", dense)
    fitted = {e: fit_attention_routers(dense, calibration, num_experts=e) for e in (3, 9)}
    for num_experts, top_k in ((3, 1), (3, 2), (9, 3), (9, 6)):
        fields = dict(
            num_attention_experts=num_experts, num_attention_experts_per_tok=top_k,
            attention_score_scale_factor=float(top_k),
        )
        for router in ("random", "fit", "oracle"):
            routers = fitted[num_experts] if router == "fit" else None
            model = attn_moe_from_dense(dense, router_init="random", routers=routers, **fields)
            if router == "oracle":
                install_oracle(model, top_k)
            report(f"attention {num_experts}top{top_k}, {router} router", model)
            del model

    # MLP MoE alone and combined: LLaMA-MoE random split of the FFN into 8 experts, top-2, random MLP router.
    splits = {i: split_random(dense.config.intermediate_size, 8, seed=i) for i in range(dense.config.num_hidden_layers)}
    mlp = dict(moe_layers=list(splits), num_experts=8, num_experts_per_tok=2, score_scale_factor=2.0, mlp_splits=splits)
    all_heads = dict(num_attention_experts=9, num_attention_experts_per_tok=9, attention_score_scale_factor=9.0)
    no_routing = {i: torch.zeros(9, dense.config.hidden_size) for i in splits}  # all 9 heads, weight 1/9 * 9
    report("MLP 8top2 (random split, random router), attention dense",
           attn_moe_from_dense(dense, routers=no_routing, **all_heads, **mlp))
    for router in ("random", "fit"):
        routers = fitted[9] if router == "fit" else None
        model = attn_moe_from_dense(
            dense, router_init="random", routers=routers, num_attention_experts=9, num_attention_experts_per_tok=6,
            attention_score_scale_factor=6.0, **mlp,
        )
        report(f"MLP 8top2 + attention 9top6, {router} attention router", model)
        del model

    print("\n| model | held-out perplexity |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.2f} |")


if __name__ == "__main__":
    main()

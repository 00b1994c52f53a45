"""Held-out perplexity of SmolLM2-135M-Instruct converted to AttnMoE (no training), next to the dense model.

    python benchmarks/quality/quality_attn_moe.py [--chunks 32] [--seq-len 256] [--calibration-chunks 16] [--threads N]

Text: the built-in corpus (Python stdlib docstrings); the last 10% of the documents are held out, the fitted
routers are calibrated on the first 90%. Attention experts keep `attention_score_scale_factor = k`, so with a
near-uniform router the kept heads have weight ~1, as in the dense model. Routers:

    random  normal(0, 0.02): near-uniform weights, an essentially random choice of experts per token
    fit     `attn_router_init="fit"`: ridge regression of each expert's output norm on the attention input
    oracle  top-k experts by their actual output norm (computed densely per token): a reference, not a model
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaAttention

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import chunk_perplexity
from llama_moe.checkpoints import default_model_path
from llama_moe.conversion.calibration import CalibrationContext, tokenize_calibration
from llama_moe.conversion.routers.fit.attention_fit import expert_output_norms
from llama_moe.text.corpus import stdlib_docstrings
from llama_moe_hf import MoERecipe, build_moe
from llama_moe_hf.modeling.cache_compat import CACHE_ARG
from llama_moe_hf.modeling.modeling_attn_moe import AttnMoEAttention


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
            dense_kwargs = {k: v for k, v in kwargs.items() if k != CACHE_ARG}
            LlamaAttention.forward(module, **dense_kwargs)  # the dense heads, no routing, no cache update
            handle.remove()
            heads = captured["heads"].reshape(-1, captured["heads"].shape[-1])
            module.gate.norms = expert_output_norms(heads, module.o_proj.weight, module.num_experts)

        attention.register_forward_pre_hook(pre_hook, with_kwargs=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--calibration-chunks", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return parser.parse_args()


def load_data(args):
    """The dense model and the held-out and calibration chunks of the docstring corpus (last 10% / first 90%)."""
    path = default_model_path()
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    docs = stdlib_docstrings()
    cut = int(len(docs) * 0.9)
    held_out = tokenize_calibration(docs[cut:], tokenizer, args.chunks * args.seq_len, args.seq_len)
    calibration = tokenize_calibration(docs[:cut], tokenizer, args.calibration_chunks * args.seq_len, args.seq_len)
    print(
        f"held-out: {held_out.shape[0]} x {held_out.shape[1]} tokens from {len(docs) - cut} docs; "
        f"calibration: {calibration.shape[0]} x {calibration.shape[1]} tokens"
    )
    return dense, held_out, calibration


def attention_rows(dense, contexts: dict, report) -> None:
    """AttnMoE alone: 3 and 9 attention experts at two top-k each, with a random, a fitted and an oracle router."""
    for num_experts, top_k in ((3, 1), (3, 2), (9, 3), (9, 6)):
        fields = {"attn_experts": num_experts, "attn_top_k": top_k, "attn_score_scale_factor": float(top_k)}
        for router in ("random", "fit", "oracle"):
            init = "fit" if router == "fit" else "random"
            model = build_moe(dense, context=contexts[num_experts], attn_router_init=init, **fields)
            if router == "oracle":
                install_oracle(model, top_k)
            report(f"attention {num_experts}top{top_k}, {router} router", model)
            del model


def mlp_rows(dense, contexts: dict, report) -> None:
    """MLP MoE alone and combined: LLaMA-MoE random split of the FFN into 8 experts, top-2, random MLP router."""
    mlp = {"method": "random", "num_experts": 8, "top_k": 2, "score_scale_factor": 2.0, "router_init": "random"}
    report("MLP 8top2 (random split, random router), attention dense", build_moe(dense, **mlp))
    for router in ("random", "fit"):
        model = build_moe(
            dense,
            context=contexts[9],
            mlp_moe=True,
            family="attn_moe",
            attn_experts=9,
            attn_top_k=6,
            attn_score_scale_factor=6.0,
            attn_router_init=router,
            **mlp,
        )
        report(f"MLP 8top2 + attention 9top6, {router} attention router", model)
        del model


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dense, held_out, calibration = load_data(args)
    rows = []

    def report(name, model):
        start = time.perf_counter()
        value = chunk_perplexity(model, held_out, batch_size=8)
        rows.append((name, value))
        print(f"| {name} | {value:.2f} |  ({time.perf_counter() - start:.0f} s)", flush=True)

    report("dense", dense)
    # One calibration context per expert count: the builds that share it fit their routers on one pass (a context
    # keys the fit's statistics by layer only, so the two counts cannot share one).
    contexts = {
        e: CalibrationContext(MoERecipe(), lambda *_: dense, input_ids=calibration, device=str(dense.device))
        for e in (3, 9)
    }
    attention_rows(dense, contexts, report)
    mlp_rows(dense, contexts, report)
    for context in contexts.values():
        context.release()
    print("\n| model | held-out perplexity |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.2f} |")


if __name__ == "__main__":
    main()

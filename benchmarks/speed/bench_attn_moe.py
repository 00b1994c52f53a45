"""Attention-block time of AttnMoE vs the dense LlamaAttention, with the share of FLOPs each design saves.

    python benchmarks/speed/bench_attn_moe.py [--lengths 256 2048] [--repeats 5] [--threads 1]

One attention block with SmolLM2-135M's shapes (hidden 576, 9 query heads / 3 KV heads, head_dim 64), batch 1,
float32, sdpa, causal prefill, no grad, random weights and a random router (balanced routing). The variants
take turns `--repeats` times; the minimum is the least disturbed by other processes.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import interleaved_times
from llama_moe.source_families import dense_config_fields
from llama_moe_hf import AttnMoEConfig
from llama_moe_hf.modeling.modeling_attn_moe import AttnMoEAttention

SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    num_hidden_layers=1,
    vocab_size=128,
    max_position_embeddings=4096,
)


def attention_flops(config, tokens: int, fraction: float = 1.0, num_router_experts: int = 0) -> float:
    """Forward FLOPs of one causal attention block; `fraction` of the (token, head) pairs run q/scores/o."""
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    q_width, kv_width = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    projections_kv = 2 * tokens * hidden * 2 * kv_width
    per_query = 2 * tokens * hidden * q_width * 2 + 2 * 2 * q_width * tokens * (tokens + 1) / 2  # q, o; QK^T, PV
    return projections_kv + fraction * per_query + 2 * tokens * hidden * num_router_experts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    dense_config = LlamaConfig(**SMOLLM2, attn_implementation="sdpa")
    dense = LlamaAttention(dense_config, layer_idx=0).eval()
    variants = [("dense LlamaAttention", dense, 1.0, 0)]
    for num_experts, top_k in ((3, 1), (9, 3), (9, 6)):
        for implementation in ("masked", "gathered"):
            config = AttnMoEConfig(
                **dense_config_fields(dense_config),
                num_attention_experts=num_experts,
                num_attention_experts_per_tok=top_k,
                attention_experts_implementation=implementation,
                attn_implementation="sdpa",
            )
            module = AttnMoEAttention(config, layer_idx=0).eval()
            module.load_state_dict(dense.state_dict(), strict=False)
            torch.nn.init.normal_(module.gate.weight, std=0.02)
            fraction = top_k / num_experts if implementation == "gathered" else 1.0
            variants.append((f"AttnMoE {num_experts}top{top_k} {implementation}", module, fraction, num_experts))

    rotary = LlamaRotaryEmbedding(dense_config)
    print(f"torch threads: {torch.get_num_threads()}")
    print("| attention block | tokens | min time (ms) | median (ms) | min vs dense | FLOPs vs dense |")
    print("|---|---|---|---|---|---|")
    for tokens in args.lengths:
        hidden = torch.randn(1, tokens, dense_config.hidden_size)
        inputs = dict(
            hidden_states=hidden,
            position_embeddings=rotary(hidden, torch.arange(tokens)[None]),
            attention_mask=None,  # causal, no padding: the sdpa fast path
        )
        calls = {name: (lambda m=module, i=inputs: m(**i)) for name, module, _, _ in variants}
        with torch.no_grad():  # the variants take turns after one warm-up call each
            times = interleaved_times(calls, args.repeats, warmup=1)
        dense_time, dense_flops = min(times[variants[0][0]]), attention_flops(dense_config, tokens)
        for name, _, fraction, router_experts in variants:
            module_times = times[name]
            flops = attention_flops(dense_config, tokens, fraction, router_experts)
            print(
                f"| {name} | {tokens} | {min(module_times) * 1e3:.1f} | {statistics.median(module_times) * 1e3:.1f} | "
                f"{min(module_times) / dense_time:.2f}x | {flops / dense_flops:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

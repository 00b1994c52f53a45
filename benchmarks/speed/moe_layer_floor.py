"""How fast can a top-k MoE layer be on this machine? Lower bounds next to the dense FFN, cold cache.

`bench_moe_layer.py` compares whole MoE blocks. This script times what any MoE block must at least do, with the same
shapes and the same cold-cache, round-robin timing, so a target ratio can be checked for feasibility:

    dense            the dense SwiGLU FFN (gate, up, down) the experts are cut from
    expert matmuls   only the routed experts' matmuls on rows already grouped by expert (no router, no gather, no
                     scatter, no weighting): the work left if every other step were free
    padded bmm       the same as two batched matmuls over all experts, each expert's rows zero-padded to the
                     largest count (the form our default uses for up to 128 rows per expert)
    one matmul       one matmul of the T input rows with a contiguous k/N slice of the dense weights: the FLOPs of a
                     top-k layer (and its weight bytes at 1 token) as a single GEMM, the form this CPU runs fastest
    ours             our whole MoE block (router included, default experts implementation) with the same expert
                     weights, timed in the same rounds: the last column is its time over `expert matmuls`

    python benchmarks/speed/moe_layer_floor.py                     # 1, 16, 256 and 2048 tokens, 2 threads
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import interleaved_times, medians
from llama_moe_hf import LlamaMoEConfig, LlamaMoEForCausalLM


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--intermediate-size", type=int, default=4096)
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flush-mb", type=int, default=128)
    return parser.parse_args()


def make_weights(args) -> dict[str, torch.Tensor]:
    """The dense FFN's weights, the experts' (`gate_up` [E, 2m, H], `down` [E, H, m]) and a k/N slice of them."""
    hidden, inter, size = args.hidden_size, args.intermediate_size, args.intermediate_size // args.num_experts
    gate, up, down = (torch.randn(inter, hidden) * 0.02 for _ in range(3))
    return {
        "gate": gate,
        "up": up,
        "down": down,
        "gate_up": torch.randn(args.num_experts, 2 * size, hidden) * 0.02,
        "expert_down": torch.randn(args.num_experts, hidden, size) * 0.02,
        # The bytes of k experts' gate_up and down, as one contiguous weight: [3 * k * m, H]
        "slice": torch.randn(3 * args.top_k * size, hidden) * 0.02,
    }


def floor_functions(num_tokens: int, w: dict, ours, args) -> dict:
    """{name: call} of the dense FFN, the lower bounds and our block on `num_tokens` random rows, routed at random."""
    hidden, experts = args.hidden_size, args.num_experts
    x = torch.randn(num_tokens, hidden)
    routing = torch.stack([torch.randperm(experts)[: args.top_k] for _ in range(num_tokens)])
    counts = torch.bincount(routing.flatten(), minlength=experts).tolist()
    grouped = [torch.randn(count, hidden) for count in counts]  # each expert's rows, already gathered
    padded = torch.randn(experts, max(counts), hidden)  # [E, C, H], C = the largest count
    gate_up, expert_down = w["gate_up"], w["expert_down"]

    def dense_ffn():
        F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"].T)

    def expert_matmuls():
        for e, rows in enumerate(grouped):
            if rows.shape[0]:
                g, u = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
                F.linear(F.silu(g) * u, expert_down[e])

    def padded_bmm():
        g, u = torch.bmm(padded, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        torch.bmm(F.silu(g) * u, expert_down.transpose(1, 2))

    return {
        "dense": dense_ffn,
        "expert matmuls": expert_matmuls,
        "padded bmm": padded_bmm,
        "one matmul": lambda: F.linear(x, w["slice"]),
        "ours": lambda: ours(x[None]),
    }


def main():
    args = parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    w = make_weights(args)
    flush = torch.empty(args.flush_mb * 2**20 // 4)
    ours = our_block(args, w["gate_up"], w["expert_down"])
    experts, top_k = args.num_experts, args.top_k
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, float32, cold cache | H={args.hidden_size}, "
        f"dense FFN={args.intermediate_size}, {experts} experts x {args.intermediate_size // experts}, "
        f"top-{top_k}, ideal k/N={top_k / experts}"
    )
    print("| tokens | dense ms | expert matmuls | padded bmm | one matmul | ours | ours / expert matmuls |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for num_tokens in args.tokens:
            functions = floor_functions(num_tokens, w, ours, args)
            median = medians(interleaved_times(functions, args.repeats, warmup=3, before=flush.fill_))
            ratios = " | ".join(f"{median[name] / median['dense']:.3f}" for name in list(functions)[1:])
            over_floor = median["ours"] / median["expert matmuls"]
            print(f"| {num_tokens} | {median['dense'] * 1e3:.3f} | {ratios} | {over_floor:.2f} |", flush=True)


def our_block(args, gate_up: torch.Tensor, expert_down: torch.Tensor) -> torch.nn.Module:
    """Our MoE block as users get it (built through the model class: its default experts implementation), holding the
    same expert weights, with a random router (near-uniform routing, like the floors' random choice)."""
    config = LlamaMoEConfig(
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size, num_experts=args.num_experts,
        num_experts_per_tok=args.top_k, num_hidden_layers=1, vocab_size=16,
    )  # fmt: skip
    block = LlamaMoEForCausalLM(config).model.layers[0].mlp.eval()
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(expert_down)
        torch.nn.init.normal_(block.gate.weight, std=0.02)
    return block


if __name__ == "__main__":
    main()

"""Forward and backward of the routed experts alone, as the layer heal trains them: the default CPU dispatch
(`llama_moe_cpu`) against transformers' `grouped_mm` and the plain reference loop (`eager`), in the same run.

    python benchmarks/speed/experts_backward.py                       # Llama-3-8B's MLP in 6 experts, top-2, 512 tokens
    python benchmarks/speed/experts_backward.py --hidden 576 --intermediate 1536 --experts 6   # SmolLM2-135M's

Float32, random weights (time does not depend on the values); `--repeats` steps after a warm-up, the median reported.
"""

import argparse
import statistics
import time
import types

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from llama_moe_hf.modeling.modeling_llama_moe import LlamaMoEExperts


def step_seconds(experts, function, states, index, weights, repeats: int) -> tuple[float, float]:
    """Median (forward, backward) seconds of `function` on the inputs."""
    times = []
    for _ in range(repeats + 1):
        experts.zero_grad(set_to_none=True)
        start = time.perf_counter()
        output = function(experts, states, index, weights)
        middle = time.perf_counter()
        output.pow(2).sum().backward()
        times.append((middle - start, time.perf_counter() - middle))
    forward, backward = zip(*times[1:])
    return statistics.median(forward), statistics.median(backward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336, help="the dense MLP's, split over 8 experts")
    parser.add_argument("--experts", type=int, default=6, help="routed experts (8 - 2 shared, as sparse-50)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512, help="the layer heal's batch (heal_batch_tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = types.SimpleNamespace(
        num_experts=args.experts,
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate // 8,
        hidden_act="silu",
        _experts_implementation="eager",
    )
    experts = LlamaMoEExperts(config)
    for weight in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(weight, std=0.02)
    states = torch.randn(args.tokens, args.hidden)
    index = torch.randn(args.tokens, args.experts).topk(args.top_k, dim=-1).indices
    weights = torch.rand(args.tokens, args.top_k)
    functions = {
        "llama_moe_cpu": ALL_EXPERTS_FUNCTIONS["llama_moe_cpu"],
        "grouped_mm": ALL_EXPERTS_FUNCTIONS["grouped_mm"],
        "eager": LlamaMoEExperts.forward,
    }
    print(f"{args.experts} experts of {args.intermediate // 8} x {args.hidden}, top-{args.top_k}, {args.tokens} tokens")
    for name, function in functions.items():
        forward, backward = step_seconds(experts, function, states, index, weights, args.repeats)
        print(f"{name:14s} forward {forward:.3f} s  backward {backward:.3f} s")


if __name__ == "__main__":
    main()

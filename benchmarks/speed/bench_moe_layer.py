"""MoE layer forward speed: LlamaMoESparseMoeBlock vs transformers' MixtralSparseMoeBlock vs the dense SwiGLU FFN.

All MoE blocks get the same router and expert weights (so every token goes to the same experts), and their outputs
are checked against each other before timing. Implementations are timed round-robin (one call of each per round)
so that load from other processes hits all of them alike; the table reports the median per implementation and its
ratio to the dense FFN (the ideal for a top-k of N even split is k/N).

    python benchmarks/speed/bench_moe_layer.py                      # defaults: H=1024, FFN=4096, 16 experts, top-4
    python benchmarks/speed/bench_moe_layer.py --tokens 1 16 --repeats 50 --threads 2
    python benchmarks/speed/bench_moe_layer.py --device cuda --dtype bfloat16   # ours (grouped_mm there) vs Mixtral's
"""

import argparse
import copy
import platform
import statistics
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, MixtralConfig
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import interleaved_times, synchronizer
from llama_moe_hf import LlamaMoEConfig, LlamaMoEForCausalLM


def build_blocks(args) -> dict[str, torch.nn.Module]:
    """Dense FFN, our MoE block (default experts implementation) and Mixtral's block per implementation."""
    expert_size = args.intermediate_size // args.num_experts
    dense_config = LlamaConfig(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size)
    ours_config = LlamaMoEConfig(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=1,
        vocab_size=16,
    )
    # Built through the model class so the default experts implementation is the one users get.
    ours = LlamaMoEForCausalLM(ours_config).model.layers[0].mlp
    for param in ours.parameters():
        torch.nn.init.normal_(param, std=0.02)
    blocks = {"dense": LlamaMLP(dense_config), f"ours ({ours_config._experts_implementation})": ours}
    for implementation in ("eager", "grouped_mm"):
        mixtral_config = MixtralConfig(
            hidden_size=args.hidden_size,
            intermediate_size=expert_size,
            num_local_experts=args.num_experts,
            num_experts_per_tok=args.top_k,
            experts_implementation=implementation,
        )
        mixtral = MixtralSparseMoeBlock(mixtral_config)
        mixtral.load_state_dict(ours.state_dict())  # same names: gate.weight, experts.gate_up_proj/down_proj
        blocks[f"mixtral {implementation}"] = mixtral
    for block in blocks.values():
        block.to(args.device, getattr(torch, args.dtype)).eval()
    return blocks


@torch.no_grad()
def assert_blocks_agree(blocks, hidden: torch.Tensor) -> None:  # hidden: [1, T, H]
    """Every MoE block gives our block's output, compared on float32 copies: in bfloat16 the routers' near-ties flip
    some tokens' experts between implementations (Mixtral's eager block at 2048 tokens on an H200)."""
    reference = None
    for name, block in blocks.items():
        if name == "dense":
            continue
        out = copy.deepcopy(block).float()(hidden.float())
        if reference is None:
            reference = out
        elif ((out - reference).norm() / reference.norm()).item() > 1e-5:
            raise AssertionError(f"{name} disagrees with our block at {hidden.shape[1]} tokens")


@torch.no_grad()
def time_blocks(blocks, num_tokens: int, args) -> dict[str, list[float]]:
    """Seconds per forward of each block on [1, T, H] inputs, timed round-robin with a cold cache."""
    # A fresh input per round (the same for every block) changes the routing, and the cache flush before each call
    # makes every block read its weights from memory, as inside a model whose other layers evict them. Without
    # this, the first MoE block of a round would warm the chosen experts for the blocks timed after it.
    dtype = getattr(torch, args.dtype)
    inputs = [torch.randn(1, num_tokens, args.hidden_size, device=args.device, dtype=dtype) for _ in range(8)]
    flush = torch.empty(args.flush_mb * 2**20 // 4, device=args.device)
    assert_blocks_agree(blocks, inputs[0])

    # Fewer repeats for the long inputs keep the whole run short; the medians are stable there anyway.
    repeats = max(5, args.repeats if num_tokens <= 256 else args.repeats // 4)
    hidden = [inputs[0]]

    def before(round_index: int) -> None:  # this round's input, and the cache flushed before every call
        hidden[0] = inputs[round_index % len(inputs)]
        flush.fill_(round_index)

    calls = {name: (lambda block=block: block(hidden[0])) for name, block in blocks.items()}
    return interleaved_times(calls, repeats, args.warmup, before, synchronizer(args.device))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--intermediate-size", type=int, default=4096, help="dense FFN size, split evenly")
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=200, help="timed rounds (a quarter above 256 tokens)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--flush-mb", type=int, default=128, help="buffer written before each call (> last-level cache)"
    )
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    ideal = args.top_k / args.num_experts
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(
        f"torch {torch.__version__}, {machine}, threads={torch.get_num_threads()}, "
        f"{args.device}, {args.dtype}, no_grad | H={args.hidden_size}, dense FFN={args.intermediate_size}, "
        f"{args.num_experts} experts x {args.intermediate_size // args.num_experts}, top-{args.top_k}, "
        f"ideal k/N={ideal}"
    )
    blocks = build_blocks(args)
    names = list(blocks)
    rows = {"median": [], "min": []}
    for num_tokens in args.tokens:
        samples = time_blocks(blocks, num_tokens, args)
        for statistic, reduce in (("median", statistics.median), ("min", min)):
            times = {name: reduce(samples[name]) for name in names}
            cells = [f"{times[name] * 1e3:.3f} ({times[name] / times['dense']:.2f})" for name in names]
            ours_vs_ideal = times[names[1]] / times["dense"] / ideal
            rows[statistic].append(f"| {num_tokens} | " + " | ".join(cells) + f" | {ours_vs_ideal:.2f} |")
        print(rows["median"][-1], flush=True)
    # The minimum is the least disturbed run: the better estimate when other processes share the cores.
    for statistic, lines in rows.items():
        print(f"\n{statistic} ms per forward (ratio to dense):")
        print("| tokens | " + " | ".join(names) + " | ours / ideal |")
        print("|" + "---|" * (len(names) + 2))
        print("\n".join(lines))


if __name__ == "__main__":
    main()

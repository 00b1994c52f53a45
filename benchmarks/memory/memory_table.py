"""Which distributed setting fits which GPU, for full fine-tuning with AdamW in bf16 mixed precision.

    python benchmarks/memory/memory_table.py > table.md

Computed, not measured: parameter counts come from each model's shapes on the meta device (no download, no GPU)
and memory from `llama_moe.footprint.estimate_memory` (its comment lists the bytes per parameter of every
strategy).
Model states only (weights, gradients, AdamW states, all-gathered working set): activations are NOT included; each
model's heading gives a rough activation estimate per 1k tokens with gradient checkpointing. A GPU-size cell is
"✓ N" when the states fit, N being the GiB per GPU left for activations, or "✗". GPU sizes are taken as GiB; real
usable memory is somewhat lower (the CUDA context alone takes about 0.5 to 1 GiB), so read a small N as ✗.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.memory`

from benchmarks.memory.model_memory import (
    STRATEGY_NAMES,
    activation_bytes_per_token,
    llama2_7b_config,
    llama3_8b_config,
    smollm2_135m_config,
)
from llama_moe.footprint import GIB, STRATEGIES, estimate_memory, moe_config, parameter_counts

GPU_SIZES_GIB = (24, 40, 80, 141)
GPU_COUNTS = (1, 8, 16)


def reference_models() -> list[tuple[str, object]]:
    """(name, MoE config) of the table's models, built by the conversion planner from the dense configs."""
    return [
        (
            "SmolLM2-135M upcycled, 8 experts top-2 (the default model)",
            moe_config(smollm2_135m_config(), method="upcycle", num_experts=8, top_k=2),
        ),
        (
            "LLaMA-2-7B split into 16 experts top-4 (LLaMA-MoE-3.5B)",
            moe_config(llama2_7b_config(), method="random", num_experts=16, top_k=4),
        ),
        (
            "LLaMA-2-7B upcycled, 8 experts top-2",
            moe_config(llama2_7b_config(), method="upcycle", num_experts=8, top_k=2),
        ),
        (
            "LLaMA-3-8B upcycled, 8 experts top-2",
            moe_config(llama3_8b_config(), method="upcycle", num_experts=8, top_k=2),
        ),
    ]


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _fit(total: float, size_gib: int) -> str:
    left = size_gib - total / GIB
    return f"✓ {left:.0f}" if left >= 0 else "✗"


def model_table(name: str, config) -> list[str]:
    counts = parameter_counts(config)
    activations = activation_bytes_per_token(config) * 1024 / GIB
    lines = [
        f"### {name}",
        "",
        f"{counts.total / 1e9:.2f} B parameters, {counts.active / 1e9:.2f} B active per token. "
        f"Activations (rough estimate, gradient checkpointing, bf16): about {activations:.2f} GiB per 1k tokens "
        "per GPU.",
        "",
        "| setting | GPUs | weights | grads | optimizer | working | total / GPU | "
        + " | ".join(f"{size} GB" for size in GPU_SIZES_GIB)
        + " |",
        "|---|---:|---:|---:|---:|---:|---:|" + "---|" * len(GPU_SIZES_GIB),
    ]
    for strategy in STRATEGIES:
        for num_gpus in GPU_COUNTS:
            m = estimate_memory(counts, strategy, num_gpus)
            cells = [STRATEGY_NAMES[strategy], str(num_gpus)]
            cells += [_gib(v) for v in (m.weights, m.gradients, m.optimizer, m.working, m.total)]
            cells += [_fit(m.total, size) for size in GPU_SIZES_GIB]
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print("Per-GPU memory (GiB) of full fine-tuning, AdamW, bf16 mixed precision; model states only, no activations.")
    print("✓ N: fits, N GiB per GPU left for activations; ✗: does not fit.")
    print()
    for name, config in reference_models():
        print("\n".join(model_table(name, config)))


if __name__ == "__main__":
    main()

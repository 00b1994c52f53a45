"""Expert construction: which dense FFN neurons each expert takes, and the fused expert tensors built from them.

Every construction method (random and sequential splits, sparse upcycling, and the calibration-based methods) ends
in an `ExpertSplit`: neuron indices per routed expert, plus the neurons of the always-on shared experts. A SwiGLU
FFN is a sum over its neurons, `down[:, j] * silu(gate[j] . x) * (up[j] . x)`, so an expert is exactly the sub-FFN of
its neurons, and the experts of a partition sum back to the dense FFN.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertSplit:
    """Neuron indices of the dense FFN's intermediate dimension.

    expert_neurons: `[E, m]`, row e = the neurons of routed expert e.
    shared_neurons: `[S * s]` neurons of the shared experts (fused into one always-on MLP), or None.
    representatives: `[E]` one neuron of each routed expert that stands for it (CMoE's analytical router), or None.
    """

    expert_neurons: torch.Tensor
    shared_neurons: torch.Tensor | None = None
    representatives: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.expert_neurons.shape[0]

    @property
    def expert_size(self) -> int:
        return self.expert_neurons.shape[1]


def check_split_sizes(intermediate_size: int, num_experts: int, num_shared_experts: int = 0) -> int:
    """Size of one expert when `intermediate_size` neurons are cut into routed + shared experts of equal size."""
    groups = num_experts + num_shared_experts
    if num_experts < 1:
        raise ValueError(f"--num-experts must be at least 1, got {num_experts}.")
    if intermediate_size % groups != 0:
        raise ValueError(
            f"Cannot split an FFN of {intermediate_size} neurons into {groups} equal experts "
            f"({num_experts} routed + {num_shared_experts} shared): {intermediate_size} is not divisible by {groups}."
        )
    return intermediate_size // groups


def _split_from_order(order: torch.Tensor, num_experts: int, num_shared_experts: int) -> ExpertSplit:
    size = check_split_sizes(order.numel(), num_experts, num_shared_experts)
    groups = order.view(num_experts + num_shared_experts, size)
    shared = groups[num_experts:].reshape(-1).sort().values if num_shared_experts else None
    return ExpertSplit(expert_neurons=groups[:num_experts].sort(dim=1).values, shared_neurons=shared)


def split_sequential(intermediate_size: int, num_experts: int, num_shared_experts: int = 0) -> ExpertSplit:
    """Neurons in order: expert 0 takes the first block, and so on; shared experts take the last blocks."""
    return _split_from_order(torch.arange(intermediate_size), num_experts, num_shared_experts)


def split_random(intermediate_size: int, num_experts: int, num_shared_experts: int = 0, seed: int = 0) -> ExpertSplit:
    """LLaMA-MoE's Independent-Random split: a seeded random permutation cut into equal blocks."""
    generator = torch.Generator().manual_seed(seed)
    return _split_from_order(torch.randperm(intermediate_size, generator=generator), num_experts, num_shared_experts)


def split_upcycle(intermediate_size: int, num_experts: int) -> ExpertSplit:
    """Sparse upcycling: every expert is a full copy of the dense FFN."""
    if num_experts < 1:
        raise ValueError(f"--num-experts must be at least 1, got {num_experts}.")
    return ExpertSplit(expert_neurons=torch.arange(intermediate_size).expand(num_experts, -1).clone())


def build_expert_tensors(
    gate_proj: torch.Tensor,  # [I, H]
    up_proj: torch.Tensor,  # [I, H]
    down_proj: torch.Tensor,  # [H, I]
    split: ExpertSplit,
) -> dict[str, torch.Tensor]:
    """Slice a dense SwiGLU FFN into the MoE block tensors, keyed by their names under `mlp.`."""
    index = split.expert_neurons  # [E, m]
    tensors = {
        # [E, 2m, H]: the gate rows of each expert, then its up rows (the order `chunk(2)` expects).
        "experts.gate_up_proj": torch.cat([gate_proj[index], up_proj[index]], dim=1).contiguous(),
        # [E, H, m]
        "experts.down_proj": down_proj[:, index].permute(1, 0, 2).contiguous(),
    }
    if split.shared_neurons is not None:
        shared = split.shared_neurons
        tensors["shared_experts.gate_proj.weight"] = gate_proj[shared].contiguous()
        tensors["shared_experts.up_proj.weight"] = up_proj[shared].contiguous()
        tensors["shared_experts.down_proj.weight"] = down_proj[:, shared].contiguous()
    return tensors

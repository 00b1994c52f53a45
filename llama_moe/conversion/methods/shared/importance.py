"""Importance-based expert construction (LLaMA-MoE Sharing-Inner / Sharing-Inter, LLaMA-MoE v2 residual MoE).

Importances are `[G, I]` tensors (`calibration.collect_calibration` with gradients): the mean |h * dL/dh| of each
neuron over the tokens of group g.

    split_sharing_inner   expert g = the top-m neurons by importance of group g (experts may overlap)
    split_sharing_inter   most-shared neurons -> shared experts, the rest partitioned by importance
    router_groups         token groups by a router's argmax (the residual MoE's importance groups)
"""

import numpy as np
import torch
import torch.nn.functional as F

from ...experts import ExpertSplit, check_split_sizes
from ..cluster.clustering import balanced_kmeans


def text_groups(embeddings: torch.Tensor, num_groups: int, *, seed: int = 0) -> torch.Tensor:
    """`[B]` group ids: the calibration sequences clustered into `num_groups` equal groups by their embeddings `[B, H]`
    (`CalibrationContext.sequence_embeddings`: each sequence's mean final hidden state)."""
    if embeddings.shape[0] < num_groups:
        raise ValueError(
            f"Grouping the calibration text into {num_groups} clusters needs at least {num_groups} sequences, got "
            f"{embeddings.shape[0]}; raise --calibration-tokens or lower --calibration-seq-len."
        )
    labels, _ = balanced_kmeans(F.normalize(embeddings, dim=1), num_groups, seed=seed)
    return labels


def split_sharing_inner(importance: torch.Tensor, expert_size: int) -> ExpertSplit:
    """importance `[E, I]` -> expert e takes the `expert_size` most important neurons of group e (overlaps allowed)."""
    intermediate_size = importance.shape[1]
    if not 1 <= expert_size <= intermediate_size:
        raise ValueError(f"Expert size must be between 1 and {intermediate_size}, got {expert_size}.")
    top = _rank(importance)[:, :expert_size]
    return ExpertSplit(expert_neurons=top.sort(dim=1).values)


def _rank(importance: torch.Tensor) -> torch.Tensor:
    """Neurons of each row from most to least important; ties go to the lower index (deterministic)."""
    return torch.sort(importance.float(), dim=1, descending=True, stable=True).indices


def _normalise(importance: torch.Tensor) -> torch.Tensor:
    # Each group's importances sum to 1, so groups with larger gradients do not dominate the assignment.
    importance = importance.double().clamp(min=0)
    return importance / importance.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)


def shared_neuron_counts(importance: torch.Tensor, expert_size: int) -> torch.Tensor:
    """`[I]`: in how many groups' top-`expert_size` neurons each neuron is."""
    top = _rank(importance)[:, :expert_size]
    return torch.bincount(top.flatten(), minlength=importance.shape[1])


def assign_by_importance(importance: torch.Tensor, neurons: torch.Tensor, expert_size: int) -> torch.Tensor:
    """Partition `neurons` among the E experts, `expert_size` each, most important (neuron, expert) pairs first.

    importance `[E, I]` (normalised per expert) -> `[E, expert_size]`. Greedy: a pair is taken when neither its
    neuron is assigned nor its expert full. O(n E log(n E)); an exact assignment (Hungarian) costs O(n^3).
    """
    num_experts = importance.shape[0]
    if neurons.numel() != num_experts * expert_size:
        raise ValueError(f"Cannot partition {neurons.numel()} neurons into {num_experts} experts of {expert_size}.")
    scores = importance[:, neurons].T.contiguous()  # [n, E]
    pairs = torch.sort(scores.flatten(), descending=True, stable=True).indices.numpy()
    owner = np.full(neurons.numel(), -1)
    room = np.full(num_experts, expert_size)
    remaining = neurons.numel()
    for pair in pairs:
        neuron, expert = divmod(int(pair), num_experts)
        if owner[neuron] < 0 and room[expert] > 0:
            owner[neuron] = expert
            room[expert] -= 1
            remaining -= 1
            if remaining == 0:
                break
    owner = torch.from_numpy(owner)
    return torch.stack([neurons[owner == e].sort().values for e in range(num_experts)])


def split_sharing_inter(importance: torch.Tensor, num_shared_experts: int) -> ExpertSplit:
    """importance `[E, I]` -> shared experts take the neurons most groups rank in their top-m (ties: higher total
    normalised importance); the remaining neurons are partitioned among the E routed experts by importance.

    Expert sizes are equal, m = I / (E + S), as for the random split.
    """
    num_experts, intermediate_size = importance.shape
    expert_size = check_split_sizes(intermediate_size, num_experts, num_shared_experts)
    normalised = _normalise(importance)
    counts = shared_neuron_counts(importance, expert_size)
    # Most shared first, then most important in total: sort by the tie-breaker, then stably by the count.
    by_total = torch.sort(normalised.sum(0), descending=True, stable=True).indices
    order = by_total[torch.sort(counts[by_total], descending=True, stable=True).indices]
    num_shared = num_shared_experts * expert_size
    shared = order[:num_shared].sort().values if num_shared_experts else None
    routed = order[num_shared:].sort().values
    return ExpertSplit(expert_neurons=assign_by_importance(normalised, routed, expert_size), shared_neurons=shared)


def router_groups(routers: dict[int, torch.Tensor]):
    """A `token_groups` callable for `collect_calibration`: each token goes to its router's argmax expert."""

    def token_groups(layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = routers[layer_idx].to(device=hidden_states.device, dtype=torch.float32)
        return (hidden_states.float() @ weight.T).argmax(dim=-1)

    return token_groups

"""CMoE's carving (Pei et al., ACL 2026): experts from the FFN neurons' activation patterns on calibration tokens.

activation_markers   `[n, I]`: which neurons are active on each token (the K largest |activations|, CMoE's ATopK)
split_carve          the most often active neurons -> shared experts; the others -> equal routed experts by a
                     balanced linear assignment of their activation patterns; one representative neuron per
                     routed expert (the rows of CMoE's analytical router, `routers/analytical.py`)
"""

import torch
import torch.nn.functional as F

from ...experts import ExpertSplit, check_split_sizes

MARKER_CHUNK_TOKENS = 4096  # tokens per activation matmul: bounds the `[t, I]` intermediates


def activation_markers(
    hidden_states: torch.Tensor,  # [n, H] calibration MLP inputs
    gate_proj: torch.Tensor,  # [I, H]
    up_proj: torch.Tensor,  # [I, H]
    active_neurons: int,
) -> torch.Tensor:
    """`[n, I]` bool: neuron j is active on token t when `|a_j(x_t)|` is among the token's `active_neurons` largest,
    with `a_j(x) = silu(x^ . g_j^) * (x^ . u_j^)` on the L2-normalised input and gate / up rows (CMoE's markers:
    normalising keeps large-norm tokens and rows from deciding what counts as active)."""
    intermediate_size = gate_proj.shape[0]
    if not 1 <= active_neurons <= intermediate_size:
        raise ValueError(f"--carve-active-neurons must be between 1 and {intermediate_size}, got {active_neurons}.")
    device = hidden_states.device
    gate, up = (F.normalize(w.to(device, torch.float32), dim=1) for w in (gate_proj, up_proj))
    markers = torch.zeros(hidden_states.shape[0], intermediate_size, dtype=torch.bool, device=device)
    for start in range(0, hidden_states.shape[0], MARKER_CHUNK_TOKENS):
        x = F.normalize(hidden_states[start : start + MARKER_CHUNK_TOKENS].float(), dim=1)
        activation = (F.silu(x @ gate.T) * (x @ up.T)).abs()
        markers[start : start + x.shape[0]].scatter_(1, activation.topk(active_neurons, dim=1).indices, True)
    return markers


def l1_distances(markers: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """`[n, k]` L1 distances between the binary columns of `markers [T, n]` and the columns of `centroids [T, k]` in
    [0, 1]: for binary a, `|a - c| = a + c - 2ac`, so one matmul instead of an `[n, k, T]` difference."""
    markers = markers.float()
    return markers.sum(0)[:, None] + centroids.sum(0)[None, :] - 2 * markers.T @ centroids


def balanced_assignment(distances: torch.Tensor, size: int) -> torch.Tensor:
    """`[n]` labels in `[0, k)`, each used `size` times (n = k * size), of least total distance `[n, k]`: the
    linear assignment of the n items to `size` copies of each of the k columns (CMoE's repeated cost matrix)."""
    from scipy.optimize import linear_sum_assignment

    _, columns = linear_sum_assignment(distances.cpu().double().repeat_interleave(size, dim=1).numpy())
    return torch.from_numpy(columns // size).long()


def split_carve(markers: torch.Tensor, num_experts: int, num_shared_experts: int = 0) -> ExpertSplit:
    """CMoE's construction from the activation markers `[T, I]` of one FFN, in experts of m = I / (N + S) neurons.

    The `S * m` neurons most often active form the shared experts. The N most often active of the rest seed the
    routed experts (their marker columns are the centroids); every remaining neuron goes to one expert by a balanced
    linear assignment on the L1 distance of its markers to the centroids (CMoE stops after this one assignment).
    Expert e's representative is its neuron closest (L1) to the mean markers of its members. Rates tie to the lower
    neuron index.
    """
    size = check_split_sizes(markers.shape[1], num_experts, num_shared_experts)
    order = torch.sort(markers.float().mean(0), descending=True, stable=True).indices
    num_shared = num_shared_experts * size
    routed = order[num_shared:].sort().values
    routed_markers = markers[:, routed].float()  # [T, n]
    seeds = torch.searchsorted(routed, order[num_shared : num_shared + num_experts])
    labels = balanced_assignment(l1_distances(routed_markers, routed_markers[:, seeds]), size)
    members = [(labels == e).nonzero().flatten() for e in range(num_experts)]  # ascending
    representatives = []
    for rows in members:
        centroid = routed_markers[:, rows].mean(1, keepdim=True)
        representatives.append(rows[l1_distances(routed_markers[:, rows], centroid).flatten().argmin()])
    return ExpertSplit(
        expert_neurons=torch.stack([routed[rows] for rows in members]),
        shared_neurons=order[:num_shared].sort().values if num_shared_experts else None,
        representatives=routed[torch.stack(representatives)],
    )

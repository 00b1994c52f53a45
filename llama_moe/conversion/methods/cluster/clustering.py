"""Balanced k-means and what is built with it: LLaMA-MoE's Independent-Clustering split and LLaMA-MoE v2's k-means
routers.

    balanced_kmeans   k-means whose clusters differ in size by at most one (exact, `k-means-constrained`)
    split_cluster     neurons whose weight rows (or calibration activation profiles) point the same way share an expert
    kmeans_router     router weight `[E, H]` = centroids of the MLP inputs
"""

import numpy as np
import torch
import torch.nn.functional as F

from ...experts import ExpertSplit, check_split_sizes
from . import CLUSTER_ON

# Calibration MLP inputs used by k-means routers and by neuron profiles (cluster_on="activations"): a seeded subset
# keeps exact balanced k-means affordable (one SmolLM2 layer: 1.8 s for 4096 points, 5.1 s for 8192, 18 s for
# 16384), while the selector, which shares the sample, uses all of it.
MAX_CLUSTER_POINTS = 4096


def balanced_kmeans(
    points: torch.Tensor, num_clusters: int, *, seed: int = 0, max_iter: int = 100
) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means whose clusters differ in size by at most one (`k-means-constrained`, exact min-cost-flow assignment).

    points `[n, d]` -> (labels `[n]` long, centroids `[k, d]` float32). Deterministic for a given seed.
    """
    num_points = points.shape[0]
    if num_points < num_clusters:
        raise ValueError(f"Balanced k-means needs at least {num_clusters} points, got {num_points}.")
    from k_means_constrained import KMeansConstrained

    kmeans = KMeansConstrained(
        n_clusters=num_clusters,
        size_min=num_points // num_clusters,
        size_max=-(-num_points // num_clusters),
        n_init=1,  # one k-means++ start: 10 starts cost 10x for a ~0.1% lower inertia on SmolLM2 (docs)
        max_iter=max_iter,
        random_state=seed,
    )
    labels = kmeans.fit_predict(points.detach().double().cpu().numpy())
    return torch.from_numpy(labels.astype(np.int64)), torch.from_numpy(kmeans.cluster_centers_).float()


def sample_rows(rows: torch.Tensor, max_rows: int, seed: int) -> torch.Tensor:
    """A seeded random subset of at most `max_rows` rows of `[n, d]` (all of them, in order, if n <= max_rows)."""
    if rows.shape[0] <= max_rows:
        return rows
    generator = torch.Generator().manual_seed(seed)
    return rows[torch.randperm(rows.shape[0], generator=generator)[:max_rows]]


def _split_from_labels(labels: torch.Tensor, num_experts: int) -> ExpertSplit:
    # Equal-size clusters -> [E, m] neuron indices, ascending within each expert.
    order = torch.argsort(labels * labels.numel() + torch.arange(labels.numel()))
    return ExpertSplit(expert_neurons=order.view(num_experts, -1))


def check_cluster_on(cluster_on: str) -> None:
    if cluster_on not in CLUSTER_ON:
        raise ValueError(f"--cluster-on must be one of {', '.join(CLUSTER_ON)}, got {cluster_on!r}.")


def split_cluster(
    gate_proj: torch.Tensor,  # [I, H]
    up_proj: torch.Tensor,  # [I, H]
    num_experts: int,
    *,
    cluster_on: str = "both",
    seed: int = 0,
    down_proj: torch.Tensor | None = None,  # [H, I], for cluster_on="activations"
    calibration=None,  # LayerCalibration, for cluster_on="activations"
) -> ExpertSplit:
    """LLaMA-MoE Independent-Clustering: neurons whose `cluster_on` rows point the same way share an expert.

    `cluster_on="activations"` clusters on calibration data instead (G-MoEfication's balanced clustering): each
    neuron is its profile `|a_j(x) - mu_j| * ||down[:, j]||` over a seeded `MAX_CLUSTER_POINTS` of the sampled MLP
    inputs, so neurons that leave their means on the same tokens share an expert and a token's deviation energy
    gathers in few experts.
    """
    check_cluster_on(cluster_on)
    check_split_sizes(up_proj.shape[0], num_experts)
    if cluster_on == "activations":
        if calibration is None or down_proj is None:
            raise ValueError("--cluster-on activations needs calibration data (the layer's MLP inputs) and down_proj.")
        h = sample_rows(calibration.hidden_states, MAX_CLUSTER_POINTS, seed).float()  # [n, H]
        activation = F.silu(h @ gate_proj.float().T) * (h @ up_proj.float().T)  # [n, I]
        deviation = (activation - calibration.mean_activation.float()) * down_proj.float().norm(dim=0)
        features = F.normalize(deviation.abs().T, dim=1)  # [I, n]
    else:
        rows = {"gate": [gate_proj], "up": [up_proj], "both": [gate_proj, up_proj]}[cluster_on]
        features = torch.cat([F.normalize(r.float(), dim=1) for r in rows], dim=1)  # [I, H] or [I, 2H]
    labels, _ = balanced_kmeans(features, num_experts, seed=seed)
    return _split_from_labels(labels, num_experts)


def kmeans_router(
    hidden_states: torch.Tensor, num_experts: int, *, seed: int = 0, max_points: int = MAX_CLUSTER_POINTS
) -> torch.Tensor:
    """Router weight `[E, H]`: centroids of balanced k-means on a seeded subset of at most `max_points` of the
    sampled MLP inputs `[n, H]` (LLaMA-MoE v2)."""
    _, centroids = balanced_kmeans(sample_rows(hidden_states, max_points, seed), num_experts, seed=seed)
    return centroids

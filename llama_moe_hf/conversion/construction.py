"""Calibration-based expert construction (LLaMA-MoE v1 and v2) and k-means router initialisation.

    split_cluster             Independent-Clustering: balanced k-means on L2-normalised FFN rows (no data needed)
                              or on the neurons' calibration activation profiles (`cluster_on="activations"`)
    split_sharing_inner       expert i = the top-m neurons by importance of calibration group i (experts may overlap)
    split_sharing_inter       most-shared neurons -> shared experts, the rest partitioned by importance
    residual (LLaMA-MoE v2)   `kmeans_router` on the MLP inputs, tokens grouped by router argmax, then the
                              `split_sharing_inter` rule on the per-expert importance
    save_splits / load_splits neuron indices and router weights per layer in one safetensors file
    parse_moe_layers          "0,2,5", "0-7", "last:2", "every:2", "all" -> layer indices

Importances are `[G, I]` tensors from `calibration.collect_calibration` (mean |h * dL/dh| per token group).
"""

import os
import re
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from .calibration import DEFAULT_CALIBRATION_SAMPLES, collect_calibration
from .experts import ExpertSplit, check_split_sizes

CLUSTER_ON = ("gate", "up", "both", "activations")
# Calibration MLP inputs used by k-means routers and by neuron profiles (cluster_on="activations"): a seeded subset
# keeps exact balanced k-means affordable (one SmolLM2 layer: 1.8 s for 4096 points, 5.1 s for 8192, 18 s for
# 16384), while the selector, which shares the sample, uses all of it.
MAX_CLUSTER_POINTS = 4096
SPLIT_FILE_FORMAT = "llama-moe-hf-split/1"


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


def split_sharing_inner(importance: torch.Tensor, expert_size: int) -> ExpertSplit:
    """importance `[E, I]` -> expert e takes the `expert_size` most important neurons of group e (overlaps allowed)."""
    num_experts, intermediate_size = importance.shape
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
    return ExpertSplit(
        expert_neurons=assign_by_importance(normalised, routed, expert_size), shared_neurons=shared
    )


def kmeans_router(
    hidden_states: torch.Tensor, num_experts: int, *, seed: int = 0, max_points: int = MAX_CLUSTER_POINTS
) -> torch.Tensor:
    """Router weight `[E, H]`: centroids of balanced k-means on a seeded subset of at most `max_points` of the
    sampled MLP inputs `[n, H]` (LLaMA-MoE v2)."""
    _, centroids = balanced_kmeans(sample_rows(hidden_states, max_points, seed), num_experts, seed=seed)
    return centroids


def router_groups(routers: dict[int, torch.Tensor]):
    """A `token_groups` callable for `collect_calibration`: each token goes to its router's argmax expert."""

    def token_groups(layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = routers[layer_idx].to(device=hidden_states.device, dtype=torch.float32)
        return (hidden_states.float() @ weight.T).argmax(dim=-1)

    return token_groups


# ----------------------------------------------------------------------------------------------------------------
# Split files
# ----------------------------------------------------------------------------------------------------------------


def save_splits(
    path: str | Path,
    splits: dict[int, ExpertSplit],
    routers: dict[int, torch.Tensor] | None = None,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write neuron indices (and router weights) per layer to a safetensors file, atomically.

    Keys: `layers.{i}.expert_neurons` `[E, m]` int64, `layers.{i}.shared_neurons` `[S*s]` int64 (when present),
    `layers.{i}.router` `[E, H]` float32 (when given). Metadata: `format` plus the caller's strings.
    """
    tensors = {}
    for layer, split in splits.items():
        tensors[f"layers.{layer}.expert_neurons"] = split.expert_neurons.long().contiguous()
        if split.shared_neurons is not None:
            tensors[f"layers.{layer}.shared_neurons"] = split.shared_neurons.long().contiguous()
    for layer, router in (routers or {}).items():
        tensors[f"layers.{layer}.router"] = router.detach().float().cpu().contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": SPLIT_FILE_FORMAT, **(metadata or {})})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


_SPLIT_KEY = re.compile(r"layers\.(\d+)\.(expert_neurons|shared_neurons|router)")


def load_splits(path: str | Path) -> tuple[dict[int, ExpertSplit], dict[int, torch.Tensor], dict[str, str]]:
    """Read a file written by `save_splits` -> (splits, routers, metadata)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Split file {path} does not exist.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for corrupt headers
        raise ValueError(f"{path} is not a readable safetensors split file: {error}") from None
    if metadata.get("format") != SPLIT_FILE_FORMAT:
        raise ValueError(f"{path} is not a llama-moe-hf split file (metadata format {metadata.get('format')!r}).")
    fields: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _SPLIT_KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{path}: unexpected tensor {key!r} in a split file.")
        fields.setdefault(int(match[1]), {})[match[2]] = tensor
    splits, routers = {}, {}
    for layer, entry in sorted(fields.items()):
        if "expert_neurons" in entry:
            splits[layer] = ExpertSplit(entry["expert_neurons"].long(), entry.get("shared_neurons"))
        if "router" in entry:
            routers[layer] = entry["router"]
    return splits, routers, metadata


def check_loaded_split(split: ExpertSplit, layer: int, intermediate_size: int, num_experts: int, expert_size: int):
    """Raise a clear error when a split read from a file does not fit the model being converted."""
    shape = tuple(split.expert_neurons.shape)
    if shape != (num_experts, expert_size):
        raise ValueError(
            f"Layer {layer} of the split file has {shape[0]} experts of {shape[1]} neurons; "
            f"this conversion needs {num_experts} of {expert_size}."
        )
    used = [split.expert_neurons] + ([split.shared_neurons] if split.shared_neurons is not None else [])
    if any(int(t.min()) < 0 or int(t.max()) >= intermediate_size for t in used):
        raise ValueError(f"Layer {layer} of the split file has neuron indices outside 0..{intermediate_size - 1}.")


# ----------------------------------------------------------------------------------------------------------------
# Layer placement
# ----------------------------------------------------------------------------------------------------------------

_LAYER_TERM = re.compile(r"(all)|(\d+)|(\d+)-(\d+)|(first|last):(\d+)|every:(\d+)(?::(\d+))?")


def parse_moe_layers(spec: str | None, num_layers: int) -> list[int]:
    """Layers to make MoE from a comma-separated list of terms (union, sorted); None or "all" -> every layer.

    Terms: `5` (one layer), `0-7` (inclusive range), `first:N`, `last:N`, `every:K` (0, K, 2K, ...),
    `every:K:OFFSET` (OFFSET, OFFSET + K, ...), `all`. Negative indices are not accepted; use `last:N`.
    """
    if spec is None:
        return list(range(num_layers))
    layers: set[int] = set()
    for term in spec.replace(" ", "").split(","):
        match = _LAYER_TERM.fullmatch(term)
        if match is None:
            raise ValueError(
                f"Cannot read --moe-layers term {term!r} in {spec!r}; use e.g. '0,2,5', '0-7', 'last:2', 'first:4', "
                "'every:2', 'every:2:1' or 'all'."
            )
        everything, single, lo, hi, side, count, step, offset = match.groups()
        if everything:
            chosen = range(num_layers)
        elif single is not None:
            chosen = [int(single)]
        elif lo is not None:
            if int(lo) > int(hi):
                raise ValueError(f"--moe-layers range {term!r} is empty (start after end).")
            chosen = range(int(lo), int(hi) + 1)
        elif side is not None:
            n = int(count)
            if not 1 <= n <= num_layers:
                raise ValueError(f"--moe-layers {term!r}: the model has {num_layers} layers.")
            chosen = range(n) if side == "first" else range(num_layers - n, num_layers)
        else:
            if int(step) < 1:
                raise ValueError(f"--moe-layers {term!r}: the step must be at least 1.")
            chosen = range(int(offset or 0), num_layers, int(step))
        layers.update(chosen)
    bad = sorted(i for i in layers if i >= num_layers)
    if bad:
        raise ValueError(f"--moe-layers {spec!r} names layers {bad}, but the model has layers 0..{num_layers - 1}.")
    if not layers:
        raise ValueError(f"--moe-layers {spec!r} selects no layer.")
    return sorted(layers)


# ----------------------------------------------------------------------------------------------------------------
# All layers at once
# ----------------------------------------------------------------------------------------------------------------

CALIBRATED_METHODS = ("cluster", "sharing-inner", "sharing-inter", "residual")


def _dense_mlp(model, layer: int):
    return getattr(model, model.base_model_prefix, model).layers[layer].mlp


def text_groups(
    model, input_ids: torch.LongTensor, num_groups: int, *, seed: int = 0, batch_size: int = 4, progress: bool = True
) -> torch.Tensor:
    """Cluster the calibration sequences into `num_groups` equal groups by their mean final hidden state -> `[B]`.

    LLaMA-MoE clustered its training texts by sentence embeddings; the dense model's own representation needs no
    extra model.
    """
    from .calibration import sequence_embeddings

    if input_ids.shape[0] < num_groups:
        raise ValueError(
            f"Grouping the calibration text into {num_groups} clusters needs at least {num_groups} sequences, got "
            f"{input_ids.shape[0]}; raise --calibration-tokens or lower --calibration-seq-len."
        )
    embeddings = F.normalize(sequence_embeddings(model, input_ids, batch_size, progress), dim=1)
    labels, _ = balanced_kmeans(embeddings, num_groups, seed=seed)
    return labels


def split_needs_data(method: str, cluster_on: str, kmeans_routers: bool) -> bool:
    """Whether `construct_splits` needs calibration text: all but `cluster` on weight rows without k-means routers."""
    return method != "cluster" or kmeans_routers or cluster_on == "activations"


def construct_splits(
    model,
    method: str,
    layers: list[int],
    *,
    num_experts: int,
    num_shared_experts: int = 0,
    expert_size: int | None = None,
    input_ids: torch.LongTensor | None = None,
    cluster_on: str = "both",
    kmeans_routers: bool = False,
    seed: int = 0,
    batch_size: int = 4,
    max_hidden_samples: int = DEFAULT_CALIBRATION_SAMPLES,
    stats: dict | None = None,
    progress: bool = True,
) -> tuple[dict[int, ExpertSplit], dict[int, torch.Tensor]]:
    """Expert splits (and k-means routers) of the dense `model`'s `layers` with a calibrated method.

    `input_ids [B, S]` (from `tokenize_calibration`) is needed when `split_needs_data`. `expert_size` only applies
    to `sharing-inner` (default I / E). Returns (splits, routers); routers are the balanced k-means centroids of each
    layer's MLP inputs, computed for `residual` and when `kmeans_routers`.
    `stats`: an earlier no-gradient `collect_calibration` result over the same data, reused for the MLP inputs.
    """
    if method not in CALIBRATED_METHODS:
        raise ValueError(f"Unknown calibrated method {method!r}; choose one of {', '.join(CALIBRATED_METHODS)}.")
    if num_shared_experts and method in ("cluster", "sharing-inner"):
        raise ValueError(f"--method {method} makes no shared experts; use sharing-inter or residual for those.")
    by_activations = method == "cluster" and cluster_on == "activations"
    if split_needs_data(method, cluster_on, kmeans_routers) and input_ids is None:
        raise ValueError(f"--method {method} needs calibration data (input_ids).")
    intermediate_size = _dense_mlp(model, layers[0]).down_proj.in_features
    check_split_sizes(intermediate_size, num_experts, num_shared_experts)
    collect = dict(batch_size=batch_size, max_hidden_samples=max_hidden_samples, seed=seed, progress=progress)

    splits, routers = {}, {}
    if method == "residual":
        # Pass 1: MLP inputs -> k-means routers. Pass 2: importance per router-assigned expert.
        hidden = stats or collect_calibration(model, input_ids, layers, **collect)
        routers = {i: kmeans_router(hidden[i].hidden_states, num_experts, seed=seed) for i in layers}
        stats = collect_calibration(
            model, input_ids, layers, with_gradients=True, token_groups=router_groups(routers),
            num_groups=num_experts, **collect,
        )
    elif method in ("sharing-inner", "sharing-inter"):
        groups = text_groups(model, input_ids, num_experts, seed=seed, batch_size=batch_size, progress=progress)
        stats = collect_calibration(
            model, input_ids, layers, with_gradients=True, sequence_groups=groups, num_groups=num_experts, **collect
        )
    elif kmeans_routers or by_activations:
        stats = stats or collect_calibration(model, input_ids, layers, **collect)

    for i in layers:
        mlp = _dense_mlp(model, i)
        if method == "cluster":
            gate, up = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()
            splits[i] = split_cluster(
                gate, up, num_experts, cluster_on=cluster_on, seed=seed, down_proj=mlp.down_proj.weight.detach(),
                calibration=stats[i] if by_activations else None,
            )
        elif method == "sharing-inner":
            splits[i] = split_sharing_inner(stats[i].importance, expert_size or intermediate_size // num_experts)
        else:
            splits[i] = split_sharing_inter(stats[i].importance, num_shared_experts)
        if kmeans_routers and i not in routers:
            routers[i] = kmeans_router(stats[i].hidden_states, num_experts, seed=seed)
    return splits, routers

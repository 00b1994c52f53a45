"""Split files: the neuron indices (and k-means routers) of a calibrated conversion, saved to be reused.

Keys: `layers.{i}.expert_neurons` `[E, m]` int64, `layers.{i}.shared_neurons` `[S*s]` int64 and
`layers.{i}.representatives` `[E]` int64 (when present), `layers.{i}.router` `[E, H]` float32 (when present).
Metadata: `format` plus the writer's strings.
"""

import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..checkpoints.atomic import atomic_file
from .experts import ExpertSplit

SPLIT_FILE_FORMAT = "llama-moe-hf-split/1"
SPLIT_FIELDS = ("expert_neurons", "shared_neurons", "representatives")  # the ExpertSplit fields, all int64


def save_splits(
    path: str | Path,
    splits: dict[int, ExpertSplit],
    routers: dict[int, torch.Tensor] | None = None,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write neuron indices (and router weights) per layer to a safetensors file, atomically.

    Keys: `layers.{i}.expert_neurons` `[E, m]` int64, `layers.{i}.shared_neurons` `[S*s]` int64 and
    `layers.{i}.representatives` `[E]` int64 (when present), `layers.{i}.router` `[E, H]` float32 (when given).
    Metadata: `format` plus the caller's strings.
    """
    tensors = {}
    for layer, split in splits.items():
        for key in SPLIT_FIELDS:
            if getattr(split, key) is not None:
                tensors[f"layers.{layer}.{key}"] = getattr(split, key).long().contiguous()
    for layer, router in (routers or {}).items():
        tensors[f"layers.{layer}.router"] = router.detach().float().cpu().contiguous()
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": SPLIT_FILE_FORMAT, **(metadata or {})})


_SPLIT_KEY = re.compile(rf"layers\.(\d+)\.({'|'.join(SPLIT_FIELDS)}|router)")


def load_splits(path: str | Path) -> tuple[dict[int, ExpertSplit], dict[int, torch.Tensor], dict[str, str]]:
    """Read a file written by `save_splits` -> (splits, routers, metadata)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Split file {path} does not exist.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as error:
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
            splits[layer] = ExpertSplit(**{key: entry[key].long() for key in SPLIT_FIELDS if key in entry})
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
    representatives = split.representatives
    if representatives is not None and (
        representatives.shape != (num_experts,) or not (split.expert_neurons == representatives[:, None]).any(1).all()
    ):
        raise ValueError(f"Layer {layer} of the split file has representatives that are not one neuron per expert.")

"""The models of a merge, read a tensor at a time: the base and the expert models, checked to be one source family of
one shape, and `MergedSource`, the dense checkpoint the merge plan streams (the base's tensors, or the average of
every model's non-FFN tensors) with each expert model's FFN beside it.
"""

import logging
import re

import torch

from ..checkpoints import open_source
from ..checkpoints.base import DenseSource

logger = logging.getLogger(__name__)

FFN = re.compile(r"\.mlp\.")
LAYER = re.compile(r"^model\.layers\.\d+\.")


def open_models(config, *, allow_pickle: bool = False, token=None, download=None) -> tuple:
    """(base, [expert sources], [shared sources]) opened and checked against the base (one ValueError each)."""
    seams = {"download": download} if download else {}

    def opened(reference, revision):
        return open_source(reference, allow_pickle=allow_pickle, revision=revision, token=token, **seams)

    base = opened(config.base_model, config.base_revision)
    base.check_complete()
    experts = [opened(e.source_model, e.revision) for e in config.experts]
    shared = [opened(e.source_model, e.revision) for e in config.shared_experts]
    for source, expert in zip(experts + shared, config.experts + config.shared_experts, strict=True):
        check_compatible(base, source, expert.describe())
    return base, experts, shared


def check_compatible(base: DenseSource, source: DenseSource, name: str) -> None:
    """One ValueError when `source` is of another family than the base, or any tensor differs in name or shape
    (read from the headers where the files have them: no tensor is loaded)."""
    if source.config.model_type != base.config.model_type:
        raise ValueError(
            f"Expert {name} is a {source.config.model_type!r} model and the base a {base.config.model_type!r} one: "
            "a merge takes models of one source family."
        )
    source.check_complete()
    base_names, names = set(base.names()), set(source.names())
    if base_names != names:
        odd = sorted(base_names ^ names)
        raise ValueError(f"Expert {name} and the base have different tensors ({len(odd)}, e.g. {odd[:2]}).")
    for tensor_name in sorted(names):
        a, b = base.shape(tensor_name), source.shape(tensor_name)
        if a != b:
            raise ValueError(
                f"Expert {name} has {tensor_name} of shape {b}, the base {a}: a merge takes models of one shape."
            )


def non_ffn_differences(base: DenseSource, sources: list[DenseSource]) -> dict[str, float]:
    """The largest relative difference `|w - w_base| / |w_base|` per tensor kind (`self_attn.q_proj.weight`,
    `model.embed_tokens.weight`, ...) over every non-FFN tensor of `sources`: how far they are from sharing them."""
    largest: dict[str, float] = {}
    for name in base.names():
        if FFN.search(name):
            continue
        reference = base.tensor(name).float()
        scale = reference.norm().clamp(min=1e-12)
        kind = LAYER.sub("", name)
        for source in sources:
            difference = float((source.tensor(name).float() - reference).norm() / scale)
            largest[kind] = max(largest.get(kind, 0.0), difference)
    return largest


def report_differences(differences: dict[str, float], non_ffn: str) -> None:
    """Log the tensor kinds the expert models do not share with the base, before anything is written."""
    differing = {kind: value for kind, value in differences.items() if value > 0}
    if not differing:
        logger.info("The expert models share every non-FFN weight with the base.")
        return
    kept = "the base's are used" if non_ffn == "base" else "their average is used"
    logger.warning("The expert models' non-FFN weights differ from the base's (%s):", kept)
    for kind, value in sorted(differing.items(), key=lambda item: -item[1]):
        logger.warning("  %-40s largest relative difference %.3g", kind, value)


class MergedSource(DenseSource):
    """The base checkpoint as the merge plan reads it: its tensors (or, with `average`, the mean over the base and
    the expert models of each non-FFN tensor), and `expert_ffn(i, layer)`: expert model i's FFN in LLaMA layout."""

    def __init__(self, base: DenseSource, experts: list[DenseSource], shared: list[DenseSource], average: bool):
        super().__init__(base.path, base.config, hub_id=base.hub_id, description=base.description)
        self.base, self.experts, self.shared, self.average = base, experts, shared, average
        self.license, self.reference = base.license, base.reference
        self.tokenizer_source = base.tokenizer_source

    def names(self) -> list[str]:
        return self.base.names()

    def tensor(self, name: str) -> torch.Tensor:
        tensor = self.base.tensor(name)
        if not self.average or FFN.search(name) or not tensor.is_floating_point():
            return tensor
        total = tensor.float() + sum(source.tensor(name).float() for source in self.experts)
        return (total / (1 + len(self.experts))).to(tensor.dtype)

    def ffn(self, source: DenseSource, layer_idx: int) -> dict[str, torch.Tensor]:
        """`gate_proj.weight`, `up_proj.weight`, `down_proj.weight` of one layer of `source`."""
        prefix = f"model.layers.{layer_idx}."
        names = [n for n in source.layer_names(layer_idx) if n.startswith(prefix + "mlp.")]
        tensors = source.family.to_llama_layout({n[len(prefix) :]: source.tensor(n) for n in names})
        return {k[len("mlp.") :]: v for k, v in tensors.items()}

    def save_extras(self, out_dir) -> None:
        self.base.save_extras(out_dir)

    def load_model(self, dtype=None, device=None):
        return self.base.load_model(dtype, device)

    def load_tokenizer(self):
        return self.base.load_tokenizer()

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

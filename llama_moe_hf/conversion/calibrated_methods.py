"""Converter methods that need calibration: `cluster`, `sharing-inner`, `sharing-inter`, `residual`, and the
`--router-init kmeans` router of any method.

Calibration needs forward (and backward) passes, so these load the whole dense model once (`source.load_model()`,
on the GPU when there is one); writing the converted checkpoint still streams one layer at a time. All layers are
constructed in one calibration pass before the first layer is written. `--save-split` / `--load-split` store or reuse
the neuron indices and routers (`construction.save_splits`).
"""

import logging

import torch

from .calibration import LayerCalibration, collect_calibration, load_calibration_texts, tokenize_calibration
from .construction import (
    check_loaded_split,
    construct_splits,
    kmeans_router,
    load_splits,
    save_splits,
    split_needs_data,
)
from .convert import METHODS, ExpertMethod, SplitMethod

logger = logging.getLogger(__name__)


def moe_layers(method: ExpertMethod) -> list[int]:
    layers = method.options.moe_layers
    return sorted(layers) if layers is not None else list(range(method.dense_config.num_hidden_layers))


def dense_model(method: ExpertMethod):
    """The dense source model for calibration passes, loaded once per conversion (float32 on CPU)."""
    if getattr(method, "_dense_model", None) is None:
        cuda = torch.cuda.is_available()
        model = method.source.load_model(dtype=None if cuda else torch.float32)
        method._dense_model = model.to("cuda") if cuda else model
    return method._dense_model


def _load_tokenizer(source):
    from transformers import AutoTokenizer

    if source.path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    return AutoTokenizer.from_pretrained(source.path)


def calibration_input_ids(method: ExpertMethod) -> torch.LongTensor:
    """`[B, seq_len]` calibration tokens per the options (`calibration_data`, `_tokens`, `_seq_len`), made once."""
    if getattr(method, "_calibration_ids", None) is None:
        o = method.options
        texts, description = load_calibration_texts(
            o.calibration_data, max_chars=16 * o.calibration_tokens  # a streamed dataset stops early
        )
        method._calibration_ids = tokenize_calibration(
            texts, _load_tokenizer(method.source), o.calibration_tokens, o.calibration_seq_len
        )
        num_sequences, seq_len = method._calibration_ids.shape
        logger.info("Calibration data: %s -> %d sequences of %d tokens.", description, num_sequences, seq_len)
    return method._calibration_ids


def layer_calibration(method: ExpertMethod) -> dict[int, LayerCalibration]:
    """Per MoE layer: MLP input sample and mean activation of the dense model (no gradients), one pass per conversion.

    `ExpertMethod.calibration()` returns this; methods and router inits that need statistics share it.
    """
    if getattr(method, "_layer_calibration", None) is None:
        o = method.options
        method._layer_calibration = collect_calibration(
            dense_model(method), calibration_input_ids(method), moe_layers(method),
            batch_size=o.calibration_batch_size, max_hidden_samples=o.calibration_samples, seed=o.seed,
            progress=o.progress,
        )
    return method._layer_calibration


def kmeans_routers(method: ExpertMethod) -> dict[int, torch.Tensor]:
    """`--router-init kmeans`: per MoE layer, balanced k-means centroids of the sampled MLP inputs."""
    if getattr(method, "_kmeans_routers", None) is None:
        o = method.options
        stats = layer_calibration(method)
        method._kmeans_routers = {
            i: kmeans_router(layer.hidden_states, o.num_experts, seed=o.seed) for i, layer in stats.items()
        }
    return method._kmeans_routers


class CalibratedSplit(SplitMethod):
    """Base of the calibrated split methods: every layer's split is computed (or read) once, on first use."""

    construction = ""  # the `construct_splits` method name
    uses_split_files = True

    def __init__(self, options, source):
        super().__init__(options, source)
        if self.construction == "residual" and options.router_init == "random":
            # v2 routes by the centroids its experts were built from (the options are this conversion's own copy).
            options.router_init = "kmeans"

    def prepare(self) -> None:
        self._build_splits()
        super().prepare()

    def _build_splits(self) -> None:
        if getattr(self, "_splits", None) is not None:
            return
        o = self.options
        layers = moe_layers(self)
        if o.load_split:
            self._splits, routers, metadata = load_splits(o.load_split)
            logger.info("Read the expert split from %s (%s).", o.load_split, metadata.get("method", "unknown method"))
            missing = [i for i in layers if i not in self._splits]
            if missing:
                raise ValueError(f"Split file {o.load_split} has no split for MoE layers {missing}.")
            for i in layers:
                check_loaded_split(
                    self._splits[i], i, self.dense_config.intermediate_size, o.num_experts, self.expert_size()
                )
            if o.router_init == "kmeans":
                if not all(i in routers for i in layers):
                    raise ValueError(f"Split file {o.load_split} holds no k-means routers for every MoE layer.")
                self._kmeans_routers = routers
        else:
            kmeans = o.router_init == "kmeans" or self.construction == "residual"
            needs_data = split_needs_data(self.construction, o.cluster_on, kmeans)
            # Methods without a gradient pass take the MLP inputs from the shared no-gradient pass.
            shared_pass = needs_data and self.construction in ("cluster", "residual")
            self._splits, routers = construct_splits(
                dense_model(self),
                self.construction,
                layers,
                num_experts=o.num_experts,
                num_shared_experts=o.num_shared_experts,
                input_ids=calibration_input_ids(self) if needs_data else None,
                cluster_on=o.cluster_on,
                kmeans_routers=kmeans,
                seed=o.seed,
                batch_size=o.calibration_batch_size,
                max_hidden_samples=o.calibration_samples,
                stats=layer_calibration(self) if shared_pass else None,
                progress=o.progress,
            )
            if routers:
                self._kmeans_routers = routers
        if o.save_split:
            save_splits(
                o.save_split, self._splits, getattr(self, "_kmeans_routers", None), metadata={"method": o.method}
            )
            logger.info("Wrote the expert split to %s.", o.save_split)

    def split(self, layer_idx, gate_proj, up_proj, down_proj):
        self._build_splits()
        return self._splits[layer_idx]

    def calibration_routers(self) -> dict[int, torch.Tensor]:
        self._build_splits()  # the split's own pass (or the split file) may already hold the routers
        return super().calibration_routers()

    def conversion_info(self) -> dict:
        o = self.options
        info = {"cluster_on": o.cluster_on} if self.construction == "cluster" else {}
        if o.load_split:
            info["split_file"] = str(o.load_split)
        kmeans = o.router_init == "kmeans"
        builds_split = not o.load_split and split_needs_data(self.construction, o.cluster_on, kmeans)
        if builds_split or o.compensation or o.router_init == "selector":
            info.update(
                calibration_data=o.calibration_data or "built-in stdlib docstrings",
                calibration_tokens=o.calibration_tokens,
                calibration_seq_len=o.calibration_seq_len,
                calibration_samples=o.calibration_samples,
            )
        return info


class ClusterSplit(CalibratedSplit):
    description = (
        "LLaMA-MoE Independent-Clustering: balanced k-means of the FFN neurons (their L2-normalised rows, or their "
        "calibration activation profiles with --cluster-on activations); each cluster is an expert."
    )
    allows_shared_experts = False
    construction = "cluster"


class SharingInnerSplit(CalibratedSplit):
    description = (
        "LLaMA-MoE Sharing-Inner: calibration texts clustered into N groups; expert i takes the neurons most important "
        "(|h * dL/dh|) for group i, so experts may share neurons."
    )
    allows_shared_experts = False
    construction = "sharing-inner"


class SharingInterSplit(CalibratedSplit):
    description = (
        "LLaMA-MoE Sharing-Inter: neurons most groups rank important form the shared experts; the rest are assigned "
        "to routed experts by importance, without overlap."
    )
    construction = "sharing-inter"


class ResidualSplit(CalibratedSplit):
    description = (
        "LLaMA-MoE v2 residual MoE: router rows are balanced k-means centroids of the MLP inputs; per-expert "
        "importance over the tokens each expert receives; the most shared neurons form the shared experts."
    )
    construction = "residual"


METHODS["cluster"] = ClusterSplit
METHODS["sharing-inner"] = SharingInnerSplit
METHODS["sharing-inter"] = SharingInterSplit
METHODS["residual"] = ResidualSplit

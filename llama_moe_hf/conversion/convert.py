"""Streaming dense -> MoE conversion.

    source checkpoint --(one layer at a time)--> method.build_mlp / family.transform_attention --> sharded safetensors

Two seams keep new conversion methods and model families one registration away:

- `METHODS`: method name -> `ExpertMethod` subclass. A method turns one dense FFN (gate/up/down) into the tensors of
  an MoE block (router `gate.weight` included) and says which config fields it needs. Splitting methods subclass
  `SplitMethod` and only choose the neurons of each expert.
- `FAMILIES`: config `model_type` -> `ModelFamily` subclass. A family builds the output config (class, fields) and may
  rewrite each layer's attention tensors (identity for LlamaMoE).

Everything is written into a temporary folder next to the output and renamed at the very end, so a failed or
interrupted conversion leaves nothing behind and never touches the source.
"""

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from huggingface_hub.errors import StrictDataclassError
from tqdm.auto import tqdm
from transformers.dynamic_module_utils import custom_object_save

from ..modeling import LlamaMoEConfig, LlamaMoEForCausalLM
from .calibration import DEFAULT_CALIBRATION_SAMPLES
from .card import write_model_card
from .checkpoint import DEFAULT_MAX_SHARD_SIZE, ShardedWriter
from .construction import check_cluster_on, parse_moe_layers
from .experts import ExpertSplit, build_expert_tensors, check_split_sizes, split_random, split_sequential, split_upcycle
from .gmoefication import check_selector_objective, gmoefication_tensors
from .source import DenseSource, Downloader, open_source, snapshot_download

ROUTER_INITS = ("random", "zero", "kmeans", "selector")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Dense config fields that describe the source file rather than the model.
_DROPPED_CONFIG_KEYS = (
    "model_type",
    "architectures",
    "auto_map",
    "transformers_version",
    "dtype",
    "quantization_config",
)


def dense_config_fields(config) -> dict:
    """The model fields of a dense LLaMA-family config, to build an MoE config from: `LlamaMoEConfig(**fields, ...)`."""
    return {k: v for k, v in config.to_dict().items() if k not in _DROPPED_CONFIG_KEYS and not k.startswith("_")}


@dataclass
class ConversionOptions:
    """Every setting of a conversion; `llama-moe convert` fills it from its flags (docs/cli.md)."""

    method: str = "random"  # a key of METHODS
    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 0
    score_scale_factor: float | None = None  # None: the method's default (N/k for splits, 1.0 for upcycling)
    router_init: str = "random"  # "random": normal(0, initializer_range), seeded; "zero": uniform routing
    router_type: str = "top_k"
    moe_layers: list[int] | str | None = None  # None: every layer; a str is a pattern ("last:2", "every:2", ...)
    seed: int = 0
    dtype: str | None = None  # float32 / bfloat16 / float16; None: the source's dtype
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    family: str = "llama_moe"  # a key of FAMILIES
    allow_pickle: bool = False
    base_model: str | None = None  # Hub id of the source for the model card; found automatically for Hub sources
    license: str | None = None  # model card license; default: the source's (from its README.md) if known
    repo_id: str | None = None  # where the model will live on the Hub, used in the card's loading snippets
    progress: bool = True
    # Calibration (methods cluster, sharing-inner, sharing-inter, residual; --router-init kmeans): docs/construction.md
    calibration_data: str | None = field(
        default=None,
        metadata={"help": "text/json/jsonl/parquet file or folder, or a datasets name (default: built-in corpus)"},
    )
    calibration_tokens: int = field(default=8192, metadata={"help": "calibration tokens (default: %(default)s)"})
    calibration_seq_len: int = field(default=256, metadata={"help": "tokens per sequence (default: %(default)s)"})
    calibration_samples: int = field(
        default=DEFAULT_CALIBRATION_SAMPLES,
        metadata={"help": "MLP inputs kept per layer for the selector, k-means routers and --cluster-on activations (which use up to 4096 of them); memory: samples x hidden x 4 bytes x layers (default: %(default)s)"},
    )
    calibration_batch_size: int = field(default=4, metadata={"help": "sequences per pass (default: %(default)s)"})
    cluster_on: str = field(default="both", metadata={"help": "cluster gate, up or both rows, or activations on calibration data (default: %(default)s)"})
    save_split: str | None = field(default=None, metadata={"help": "write the split and routers to this .safetensors file"})
    load_split: str | None = field(default=None, metadata={"help": "reuse a split file written by --save-split"})
    # Attention experts (AttnMoE, LLaMA-MoE v2; family attn_moe, chosen automatically): docs/attn_moe.md
    attn_experts: int | None = field(default=None, metadata={"type": int, "help": "attention experts per layer: convert to AttnMoE (default: off)"})
    attn_top_k: int | None = field(default=None, metadata={"type": int, "help": "attention experts per token (default: half of them)"})
    attn_score_scale_factor: float | None = field(default=None, metadata={"type": float, "help": "attention expert output scale (default: --attn-top-k)"})
    attn_granularity: str | None = field(default=None, metadata={"help": "kv_group or query_heads (default: kv_group if --attn-experts <= KV heads)"})
    attn_router_init: str | None = field(default=None, metadata={"help": "attention routers: zero, random or fit (calibrated) (default: --router-init if zero/random)"})
    mlp_moe: bool = field(default=False, metadata={"help": "with --attn-experts: also turn the MLPs into MoE (the MLP options apply)"})
    # G-MoEfication (split methods; calibrated): docs/quality.md. `--router-init selector` trains MoEfication's
    # selector router (router_type "selector", unit expert weights, score scale 1.0 by default).
    compensation: bool = field(default=False, metadata={"help": "G-MoEfication: store each expert's mean output and add it for the experts a token skips"})
    selector_steps: int = field(default=100, metadata={"help": "--router-init selector: L-BFGS iterations per layer (default: %(default)s)"})
    selector_objective: str = field(default="listwise", metadata={"help": "--router-init selector: listwise ranking loss, or MoEfication's bce (default: %(default)s)"})

    def torch_dtype(self) -> torch.dtype | None:
        if self.dtype in (None, "auto"):
            return None
        if self.dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)} (or leave it unset).")
        return DTYPES[self.dtype]


def layer_seed(seed: int, layer_idx: int, stream: int) -> int:
    """Independent, reproducible seeds per (conversion seed, layer, purpose): results do not depend on layer order."""
    return int(np.random.SeedSequence([seed, layer_idx, stream]).generate_state(1)[0])


class ExpertMethod:
    """How one dense FFN becomes one MoE block. Subclass, then register: `METHODS["name"] = MyMethod`.

    Created once per conversion with the options and the opened source (`source.load_model()` gives the whole
    dense model to methods that need calibration passes).
    """

    description = ""  # one sentence for the model card
    allows_shared_experts = True

    def __init__(self, options: ConversionOptions, source: DenseSource):
        self.options = options
        self.source = source
        self.dense_config = source.config
        if options.num_shared_experts and not self.allows_shared_experts:
            raise ValueError(f"--num-shared-experts is not supported with --method {options.method}.")

    def config_fields(self) -> dict:
        """LlamaMoEConfig fields set by this method (expert sizes, score scale, ...)."""
        raise NotImplementedError

    def build_mlp(
        self,
        layer_idx: int,
        gate_proj: torch.Tensor,  # [I, H]
        up_proj: torch.Tensor,  # [I, H]
        down_proj: torch.Tensor,  # [H, I]
    ) -> dict[str, torch.Tensor]:
        """The tensors of layer `layer_idx`'s MoE block, keyed by their names under `model.layers.{i}.mlp.`."""
        raise NotImplementedError

    def conversion_info(self) -> dict:
        """Extra entries for `config.conversion_info` and the model card."""
        return {}

    @classmethod
    def card_note(cls, options: ConversionOptions) -> str:
        """What to expect from the converted model before training (model card)."""
        return (
            f"Each token uses {options.top_k} of {options.num_experts} slices of the dense FFN with an untrained "
            "router, so quality is below the dense model until the MoE is trained (LLaMA-MoE recovers it with "
            "continual pre-training). With top-k equal to the number of experts, a zero router and score scale "
            "factor equal to the number of experts it computes exactly the dense model."
        )

    def prepare(self) -> None:
        """Run every calibration pass the write needs, then free the dense model, so that the write streams."""
        o = self.options
        if o.compensation or o.router_init == "selector":
            self.calibration()
        if o.router_init == "kmeans":
            self.calibration_routers()
        self._dense_model = None

    def calibration(self) -> dict:
        """Per MoE layer `LayerCalibration` (MLP input sample, mean activation) of the dense model, computed once."""
        from .calibrated_methods import layer_calibration

        return layer_calibration(self)

    def calibration_routers(self) -> dict[int, torch.Tensor]:
        """Per MoE layer, the balanced k-means centroids of the MLP inputs `[E, H]` (`--router-init kmeans`)."""
        from .calibrated_methods import kmeans_routers

        return kmeans_routers(self)

    def init_router(self, layer_idx: int) -> torch.Tensor:
        """Router weight `[E, H]` per `options.router_init`, in float32."""
        shape = (self.options.num_experts, self.dense_config.hidden_size)
        if self.options.router_init == "zero":
            return torch.zeros(shape)
        if self.options.router_init == "kmeans":
            return self.calibration_routers()[layer_idx]
        generator = torch.Generator().manual_seed(layer_seed(self.options.seed, layer_idx, 1))
        return torch.randn(shape, generator=generator) * self.dense_config.initializer_range


class SplitMethod(ExpertMethod):
    """Methods that give each expert a subset of the dense neurons (`ExpertSplit`): subclasses implement `split`."""

    def split(self, layer_idx: int, gate_proj, up_proj, down_proj) -> ExpertSplit:
        raise NotImplementedError

    def expert_size(self) -> int:
        o = self.options
        return check_split_sizes(self.dense_config.intermediate_size, o.num_experts, o.num_shared_experts)

    def default_score_scale(self) -> float:
        if self.options.router_init == "selector":
            return 1.0  # the selector gives every chosen expert weight 1 (G-MoEfication)
        # Top-k of N equal parts of the FFN: rescale by N/k so the output keeps the dense magnitude (LLaMA-MoE).
        return self.options.num_experts / self.options.top_k

    def config_fields(self) -> dict:
        o = self.options
        size = self.expert_size()
        return {
            "moe_intermediate_size": size,
            "num_shared_experts": o.num_shared_experts,
            "shared_expert_intermediate_size": size,
            "score_scale_factor": self.default_score_scale() if o.score_scale_factor is None else o.score_scale_factor,
            "moe_compensation": o.compensation,
        }

    def build_mlp(self, layer_idx, gate_proj, up_proj, down_proj):
        o = self.options
        split = self.split(layer_idx, gate_proj, up_proj, down_proj)
        tensors = build_expert_tensors(gate_proj, up_proj, down_proj, split)
        if o.compensation or o.router_init == "selector":
            stats = self.calibration()[layer_idx]
            extra, _ = gmoefication_tensors(
                stats.hidden_states, stats.mean_activation, split, tensors, down_proj,
                compensation=o.compensation, selector=o.router_init == "selector", top_k=o.top_k,
                selector_steps=o.selector_steps, selector_objective=o.selector_objective,
                seed=layer_seed(o.seed, layer_idx, 2),
            )
            tensors.update(extra)  # `compensation`, and the selector's `gate.*`
        if o.router_init != "selector":
            tensors["gate.weight"] = self.init_router(layer_idx)
        if self.options.router_type == "noisy_top_k":
            tensors["gate.noise_weight"] = torch.zeros_like(tensors["gate.weight"])  # no noise until trained
        return tensors


class RandomSplit(SplitMethod):
    description = (
        "LLaMA-MoE Independent-Random split: each layer's FFN neurons are shuffled (seeded) and cut into equal experts."
    )

    def split(self, layer_idx, gate_proj, up_proj, down_proj):
        o = self.options
        seed = layer_seed(o.seed, layer_idx, 0)
        return split_random(gate_proj.shape[0], o.num_experts, o.num_shared_experts, seed=seed)


class SequentialSplit(SplitMethod):
    description = "Sequential split: expert e takes the e-th contiguous block of FFN neurons."

    def split(self, layer_idx, gate_proj, up_proj, down_proj):
        return split_sequential(gate_proj.shape[0], self.options.num_experts, self.options.num_shared_experts)


class Upcycle(SplitMethod):
    description = "Sparse upcycling: every expert is a full copy of the dense FFN."
    allows_shared_experts = False

    def expert_size(self) -> int:
        return self.dense_config.intermediate_size

    def default_score_scale(self) -> float:
        return 1.0  # the top-k weights sum to 1 and every expert equals the dense FFN

    @classmethod
    def card_note(cls, options: ConversionOptions) -> str:
        return (
            "Every expert is a copy of the dense FFN, so before training the model computes exactly what the dense "
            "model computes, whatever the router does. Train it (continual pre-training) to let the experts diverge."
        )

    def split(self, layer_idx, gate_proj, up_proj, down_proj):
        return split_upcycle(gate_proj.shape[0], self.options.num_experts)


METHODS: dict[str, type[ExpertMethod]] = {"random": RandomSplit, "sequential": SequentialSplit, "upcycle": Upcycle}


class ModelFamily:
    """The output model family: config and model classes, config fields, attention rewriting, active parameters.

    Register a subclass under its config's `model_type`: `FAMILIES["attn_moe"] = AttnMoEFamily`.
    """

    config_class = LlamaMoEConfig
    model_class = LlamaMoEForCausalLM

    def __init__(self, options: ConversionOptions, source: DenseSource):
        self.options = options
        self.source = source

    def build_config(self, moe_fields: dict):
        return self.config_class(**dense_config_fields(self.source.config), **moe_fields)

    def prepare(self) -> None:
        """Run the calibration passes the attention rewrite needs (after `build_config`); none here."""

    def transform_attention(self, layer_idx: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Attention tensors of one layer, keyed by their names under `model.layers.{i}.self_attn.` (kept as is)."""
        return tensors

    @staticmethod
    def active_parameters(config, name: str, numel: int) -> int:
        """Parameters of tensor `name` used per token: routed experts count k/E of their size, the rest fully."""
        if ".mlp.experts." in name:
            return numel * config.num_experts_per_tok // config.num_experts
        return numel


FAMILIES: dict[str, type[ModelFamily]] = {"llama_moe": ModelFamily}


def count_parameters(config, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """(total, active per token) parameters of a checkpoint, exactly from its tensor shapes."""
    family = FAMILIES.get(config.model_type, ModelFamily)
    total = active = 0
    for name, shape in shapes.items():
        numel = int(np.prod(shape))
        total += numel
        active += family.active_parameters(config, name, numel)
    return total, active


@dataclass
class ConversionResult:
    """What `convert_to_moe` wrote."""

    output_dir: Path
    total_parameters: int
    active_parameters: int
    files: list[str] = field(default_factory=list)


def _check_options(options: ConversionOptions) -> None:
    if options.method not in METHODS:
        raise ValueError(f"Unknown method {options.method!r}; choose one of {', '.join(METHODS)}.")
    if options.family not in FAMILIES:
        raise ValueError(f"Unknown model family {options.family!r}; choose one of {', '.join(FAMILIES)}.")
    if options.router_init not in ROUTER_INITS:
        raise ValueError(f"Unknown router init {options.router_init!r}; choose one of {', '.join(ROUTER_INITS)}.")
    if options.router_type == "selector" and options.router_init != "selector":
        raise ValueError("--router-type selector needs --router-init selector (which trains it on calibration data).")
    if options.router_init == "selector" and options.router_type not in ("top_k", "selector"):
        raise ValueError(f"--router-init selector makes a selector router; drop --router-type {options.router_type}.")
    if (options.compensation or options.router_init == "selector") and options.method == "upcycle":
        raise ValueError("--compensation and --router-init selector need a split method, not --method upcycle.")
    check_cluster_on(options.cluster_on)
    check_selector_objective(options.selector_objective)
    if options.selector_steps < 0:
        raise ValueError(f"--selector-steps must be >= 0, got {options.selector_steps}.")
    if options.calibration_samples < 1:
        raise ValueError(f"--calibration-samples must be >= 1, got {options.calibration_samples}.")
    if options.num_experts < 1:
        raise ValueError(f"--num-experts must be at least 1, got {options.num_experts}.")
    if not 1 <= options.top_k <= options.num_experts:
        raise ValueError(f"--top-k must be between 1 and --num-experts={options.num_experts}, got {options.top_k}.")
    if options.num_shared_experts < 0:
        raise ValueError(f"--num-shared-experts must be >= 0, got {options.num_shared_experts}.")
    if (options.save_split or options.load_split) and not getattr(METHODS[options.method], "uses_split_files", False):
        raise ValueError("--save-split / --load-split work with --method cluster, sharing-inner, sharing-inter or residual.")
    options.torch_dtype()


def _check_moe_layers(options: ConversionOptions, source: DenseSource) -> None:
    layers = source.config.num_hidden_layers
    bad = [i for i in options.moe_layers or [] if not 0 <= i < layers]
    if bad:
        raise ValueError(f"--moe-layers {bad} are outside 0..{layers - 1} (the source has {layers} layers).")


def _check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"Output {output} exists and is not a folder.")
    if output.exists() and not overwrite:
        raise FileExistsError(
            f"Output folder {output} already exists; pass --overwrite (overwrite=True) to replace it."
        )


def _check_not_source(output: Path, source: DenseSource) -> None:
    source_path = source.path.resolve()
    if output == source_path or output in source_path.parents:
        raise ValueError(f"Output {output} would replace the source {source.path}; choose another output folder.")


@contextmanager
def atomic_folder(output: Path) -> Iterator[Path]:
    """Yield a fresh temporary folder next to `output`; on success it replaces `output`, on any error it is removed."""
    created = [p for p in [output.parent, *output.parent.parents] if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the output folder should not be
    old = tmp.with_name(tmp.name.replace(".tmp-", ".old-"))
    try:
        yield tmp
        if output.exists():  # --overwrite: swap only now that the new folder is complete
            output.rename(old)
        tmp.rename(output)
    except BaseException:
        if old.exists() and not output.exists():  # interrupted between the two renames: restore the old folder
            old.rename(output)
        shutil.rmtree(tmp, ignore_errors=True)
        if created:  # the outermost missing parent folder we created
            shutil.rmtree(created[-1], ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def convert_to_moe(
    model: str | Path | None = None,
    output_dir: str | Path | None = None,
    options: ConversionOptions | None = None,
    *,
    overwrite: bool = False,
    token: str | None = None,
    revision: str | None = None,
    download: Downloader = snapshot_download,
    **option_fields,
) -> ConversionResult:
    """Convert a dense LLaMA checkpoint into a LlamaMoE checkpoint folder, streaming one layer at a time.

    Args:
        model: local transformers folder, Hub repository id, `.gguf` file, or None for SmolLM2-135M-Instruct.
        output_dir: the folder to create (required; refused if it exists, unless `overwrite`).
        options: a `ConversionOptions`; keyword arguments (`method=`, `num_experts=`, `top_k=`, ...) override fields.
        download: fetches Hub repositories (`huggingface_hub.snapshot_download`); tests pass a fake.

    Returns:
        A `ConversionResult` with the output folder and the total / active-per-token parameter counts.
    """
    options = replace(options or ConversionOptions(), **option_fields)
    if options.attn_experts is not None and options.family == "llama_moe":  # attention experts: the AttnMoE family
        options = replace(options, family="attn_moe")
    if output_dir is None:
        raise ValueError("convert_to_moe needs output_dir, the folder to create.")
    output = Path(output_dir).expanduser().resolve()
    _check_output(output, overwrite)  # checks that need no source come before opening (or downloading) it
    _check_options(options)
    source = open_source(model, allow_pickle=options.allow_pickle, revision=revision, token=token, download=download)
    _check_not_source(output, source)
    if isinstance(options.moe_layers, str):
        options = replace(options, moe_layers=parse_moe_layers(options.moe_layers, source.config.num_hidden_layers))
    _check_moe_layers(options, source)
    source.check_complete()

    method = METHODS[options.method](options, source)
    family = FAMILIES[options.family](options, source)
    dtype = options.torch_dtype() or source.dtype
    moe_layers = sorted(options.moe_layers) if options.moe_layers is not None else None
    info = {
        "method": options.method,
        "num_experts": options.num_experts,
        "top_k": options.top_k,
        "num_shared_experts": options.num_shared_experts,
        "router_init": options.router_init,
        "seed": options.seed,
        "source": source.description,
        **method.conversion_info(),
    }
    moe_fields = {
        "num_experts": options.num_experts,
        "num_experts_per_tok": options.top_k,
        "router_type": "selector" if options.router_init == "selector" else options.router_type,
        "moe_layers": moe_layers,
        **method.config_fields(),
    }
    info["score_scale_factor"] = moe_fields["score_scale_factor"]
    try:
        config = family.build_config({**moe_fields, "conversion_info": info})
    except StrictDataclassError as error:  # a wrongly typed option: one ValueError like every other bad setting
        raise ValueError(str(error)) from None
    config.dtype = dtype
    config.architectures = [family.model_class.__name__]

    # The shapes a freshly built model expects: every tensor a method or family writes is checked against them.
    with torch.device("meta"):
        meta_model = family.model_class(config)
    expected = {name: tuple(t.shape) for name, t in meta_model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    # Calibration passes load the whole dense model; each object frees it again before the streaming write.
    method.prepare()
    family.prepare()
    with atomic_folder(output) as tmp:
        writer = ShardedWriter(tmp, expected, dtype, options.max_shard_size)

        def write(name: str, tensor: torch.Tensor) -> None:
            if name not in expected:
                raise ValueError(
                    f"Conversion produced an unexpected tensor {name} (the {family.model_class.__name__} has no such weight)."
                )
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(
                    f"Conversion produced {name} with shape {tuple(tensor.shape)}, expected {expected[name]}."
                )
            writer.add(name, tensor)

        write("model.embed_tokens.weight", source.tensor("model.embed_tokens.weight"))
        for i in tqdm(
            range(config.num_hidden_layers), desc="Converting layers", unit="layer", disable=not options.progress
        ):
            _convert_layer(i, source, config, method, family, write)
        write("model.norm.weight", source.tensor("model.norm.weight"))
        if not config.tie_word_embeddings:
            write("lm_head.weight", source.tensor("lm_head.weight"))
        total, active = count_parameters(config, writer.shapes)
        writer.close(total_parameters=total)
        custom_object_save(meta_model, tmp, config=config)  # copies the modeling code, fills config.auto_map
        config.save_pretrained(tmp)
        source.save_extras(tmp)
        write_model_card(tmp, config, options, source, total, active, model_id=options.repo_id or str(output))
        files = sorted(p.name for p in tmp.iterdir())
    return ConversionResult(output_dir=output, total_parameters=total, active_parameters=active, files=files)


def _convert_layer(layer_idx, source, config, method, family, write) -> None:
    """Read one dense decoder layer, turn its MLP into an MoE block (if listed in moe_layers), write it."""
    prefix = f"model.layers.{layer_idx}."
    tensors = {name[len(prefix) :]: source.tensor(name) for name in source.layer_names(layer_idx)}
    attention = {k[len("self_attn.") :]: tensors.pop(k) for k in list(tensors) if k.startswith("self_attn.")}
    for name, tensor in family.transform_attention(layer_idx, attention).items():
        write(f"{prefix}self_attn.{name}", tensor)
    if layer_idx in config.moe_layers:
        dense = [tensors.pop(f"mlp.{proj}.weight") for proj in ("gate_proj", "up_proj", "down_proj")]
        for name, tensor in method.build_mlp(layer_idx, *dense).items():
            write(f"{prefix}mlp.{name}", tensor)
    for name, tensor in tensors.items():  # norms (and the dense MLP of non-MoE layers)
        write(f"{prefix}{name}", tensor)


"""The peak memory of a training run, estimated from the model's config and the run's settings before any weights
load, and the recipes' preflight that stops a run which will not fit with one line: the estimate, what is free, and
the flags that would fit (`check_training_memory`; `--force true` runs anyway).

One process holds (bytes; Psi = parameters, T = trainable parameters, N = tokens of one micro-batch):

    weights       Psi x 4 (float32; the recipes load in float32), + Psi x 2 bf16 copies under bf16/fp16 autocast
    gradients     T x 4
    optimizer     T x the optimizer's state bytes (AdamW: 8; 8-bit AdamW: 2; Adafactor: about 0; SGD: 0)
    activations   N x (per-token bytes of every decoder layer, or of the layer inputs and one layer recomputed with
                  activation checkpointing) + N x V x 12 for the logits, their log-softmax and their gradient
    teacher       the distillation teacher's weights in its dtype and its logits (N x V x 4)
    overhead      the interpreter, torch, tokenizer and data (1.0 GiB measured on CPU; the CUDA context on a GPU)

ZeRO and FSDP shard the model states as `estimate_memory` says (below). The per-token layer terms count the tensors
autograd saves in a LLaMA layer with token-choice experts (norm inputs and outputs, q/k/v after RoPE, attention
output, each selected expert's input rows, gate/up outputs, activation and product). The estimate is checked against
measured peaks by `benchmarks/memory/training_memory.py` (docs/training.md, "Memory").
"""

import dataclasses
import math
import os

from .devices import available_bytes  # noqa: F401  (the recipes' preflight and the forecast read it here)

GIB = 1024**3
OVERHEAD = {"cpu": 1.0 * GIB, "cuda": 1.5 * GIB}
HEADROOM = 0.92  # what may be planned of the free memory: the allocator and the page cache need the rest
OPTIMIZER_STATE_BYTES = {"8bit": 2, "adafactor": 0, "sgd": 0, "lion": 4, "adagrad": 4, "rmsprop": 4}
ADAMW_STATE_BYTES = 8
FORCE_HELP = "train even where the memory estimate says the run will not fit in the free memory"


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What a training process's peak depends on, besides the model."""

    batch: int  # sequences per device and micro-batch
    seq_len: int
    checkpointing: bool  # activation (gradient) checkpointing
    optimizer: str = "adamw_torch"
    mixed_precision: bool = False  # bf16 / fp16 autocast
    accumulation: int = 1
    strategy: str = "ddp"  # or "zero2", "zero3", "fsdp2"
    processes: int = 1


@dataclasses.dataclass(frozen=True)
class Footprint:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    teacher: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.teacher + self.overhead

    def describe(self) -> str:
        parts = ("weights", "gradients", "optimizer", "activations", "teacher", "overhead")
        shown = ", ".join(f"{name} {getattr(self, name) / GIB:.1f}" for name in parts if getattr(self, name))
        return f"{self.total / GIB:.1f} GiB ({shown})"


# ---------------------------------------------------------------------------------------------------------------
# Parameter counts and sharded model states
# ---------------------------------------------------------------------------------------------------------------
#
# Per-GPU bytes of the model states (weights, gradients, AdamW states, and the transient full copies that sharded
# training all-gathers) under bf16 mixed precision; Psi = total parameters, N = GPUs:
#
#     DDP (torch autocast, accelerate `mixed_precision: bf16`): fp32 weights 4 (they are the master copy), fp32
#         gradients 4, DDP's flat all-reduce buckets 4 (a second gradient copy unless `gradient_as_bucket_view=True`;
#         N > 1 only), Adam moments 4 + 4, and the bf16 copies autocast makes of every weight 2 (alive from the
#         forward to the backward)                                              -> 22 Psi (18 on one GPU)
#     ZeRO-2 (DeepSpeed bf16): bf16 weights 2 on every GPU; bf16 gradients 2, fp32 master 4, moments 4 + 4
#         partitioned                                                           -> 2 Psi + 14 Psi / N
#     ZeRO-3: all of the 16 bytes partitioned                                   -> 16 Psi / N + gathered
#     FSDP2 full shard (bf16 MixedPrecisionPolicy): sharded fp32 weights 4 (the master), fp32 gradients 4,
#         moments 4 + 4                                                         -> 16 Psi / N + gathered
#
# "gathered" (ZeRO-3, FSDP2) is an estimate of the all-gathered bf16 working set: the parameters outside the decoder
# layers (embeddings, final norm, LM head: FSDP2's root unit, which stays gathered from forward to backward), two
# decoder layers (the one computing and the one prefetched) and one layer's unsharded gradients before their
# reduce-scatter. Allocator fragmentation, the CUDA context and communication buffers come on top of all of this.

STRATEGIES = ("ddp", "zero2", "zero3", "fsdp2")
BF16, FP32 = 2, 4


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    total: int
    active: int  # used per token: routed experts count k/E of their size (the conversion's own rule)
    largest_layer: int  # the biggest decoder layer: one FSDP2 unit, what ZeRO-3 gathers for one layer
    outside_layers: int  # embeddings, final norm and LM head (counted once when tied)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of one strategy on `num_gpus` GPUs (model states only, no activations)."""

    strategy: str
    num_gpus: int
    weights: float
    gradients: float
    optimizer: float  # fp32 master weights (where separate) and both Adam moments
    working: float  # transient copies: autocast's bf16 weights (DDP), the all-gathered units (ZeRO-3, FSDP2)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.working


def meta_model(config):
    """The causal LM of `config` on the meta device: shapes only, no memory, no download."""
    import torch
    from transformers import AutoModelForCausalLM

    import llama_moe_hf  # noqa: F401  (registers the MoE families with the Auto classes)

    # The class itself, not `from_config`: under a ZeRO-3 TrainingArguments that would start deepspeed.zero.Init
    # before the run has set up its processes.
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"):
        return model_class(config)


def parameter_counts(config, model=None) -> ParameterCounts:
    """Total and active parameters of a dense LLaMA config or any of this package's MoE configs, exactly, from the
    parameter shapes of a meta-device model (`model`, or one built; tied weights counted once)."""
    from .conversion.registry import FAMILIES, count_parameters

    model = model if model is not None else meta_model(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.model_type in FAMILIES:
        total, active = count_parameters(config, shapes)
    else:  # dense: every parameter is used by every token
        total = active = sum(math.prod(shape) for shape in shapes.values())
    layers = [0] * config.num_hidden_layers
    for name, shape in shapes.items():
        if name.startswith("model.layers."):
            layers[int(name.split(".")[2])] += math.prod(shape)
    return ParameterCounts(total, active, max(layers), total - sum(layers))


def moe_config(dense_config, **recipe_fields):
    """The MoE config a conversion of `dense_config` would write (e.g. `method="upcycle", num_experts=8,
    top_k=2`), resolved by the conversion's own planner: no weights are read."""
    from .conversion.plan import ConversionPlan
    from .conversion.recipe import MoERecipe

    return ConversionPlan.create(MoERecipe.from_dict(recipe_fields), dense_config).config


def _gathered(counts: ParameterCounts) -> float:
    """Estimate of the all-gathered bf16 working set of ZeRO-3 / FSDP2 (see above)."""
    params = counts.outside_layers + 2 * counts.largest_layer
    grads = max(counts.outside_layers, counts.largest_layer)
    return BF16 * (params + grads)


def estimate_memory(counts: ParameterCounts, strategy: str, num_gpus: int) -> MemoryEstimate:
    """Per-GPU bytes of full fine-tuning with AdamW, bf16 mixed precision, under `strategy` on `num_gpus` GPUs."""
    psi, n = counts.total, num_gpus
    if strategy == "ddp":
        buckets = FP32 * psi if n > 1 else 0  # one process trains without DDP
        return MemoryEstimate(strategy, n, FP32 * psi, FP32 * psi + buckets, 2 * FP32 * psi, BF16 * psi)
    if strategy == "zero2":
        return MemoryEstimate(strategy, n, BF16 * psi, BF16 * psi / n, 3 * FP32 * psi / n, 0.0)
    if strategy == "zero3":
        return MemoryEstimate(strategy, n, BF16 * psi / n, BF16 * psi / n, 3 * FP32 * psi / n, _gathered(counts))
    if strategy == "fsdp2":
        return MemoryEstimate(strategy, n, FP32 * psi / n, FP32 * psi / n, 2 * FP32 * psi / n, _gathered(counts))
    raise ValueError(f"Unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")


# ---------------------------------------------------------------------------------------------------------------
# One training process
# ---------------------------------------------------------------------------------------------------------------


def optimizer_state_bytes(optim: str) -> float:
    """Bytes of optimizer state per trainable parameter for a `TrainingArguments.optim` name."""
    name = str(optim).lower()
    for key, size in OPTIMIZER_STATE_BYTES.items():
        if key in name:
            return size
    return ADAMW_STATE_BYTES  # AdamW and anything unknown: the common, and largest, case


def layer_elements_per_token(config) -> float:
    """Elements autograd keeps per token for one decoder layer (see the module docstring)."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    attention = 6 * hidden + 3 * q_width + 2 * kv_width
    experts = getattr(config, "num_experts", None)
    if not experts:
        return attention + hidden + 4 * config.intermediate_size
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "merge_top_k", None) or experts
    if config.model_type == "soap_moe":  # the merged weights of each segment are saved for the backward
        return attention + hidden + 4 * width + 3 * hidden * width / config.segment_length
    shared = (getattr(config, "num_shared_experts", 0) or 0) * (
        getattr(config, "shared_expert_intermediate_size", 0) or 0
    )
    return attention + 2 * experts + top_k * (3 * hidden + 4 * width) + (hidden + 4 * shared if shared else 0)


def activation_bytes(config, settings: RunSettings) -> float:
    """Activations of one micro-batch at their peak, the logits' included."""
    tokens = settings.batch * settings.seq_len
    element = 2 if settings.mixed_precision else 4
    layers = config.num_hidden_layers
    per_layer = layer_elements_per_token(config) * element
    if settings.checkpointing:
        kept = layers * config.hidden_size * element + per_layer
    else:
        kept = layers * per_layer
    logits = config.vocab_size * 12  # float32 logits, log-softmax and gradient
    return tokens * (kept + logits)


def estimate_footprint(
    counts: ParameterCounts, trainable: int, config, settings: RunSettings, teacher: float = 0.0, device: str = "cpu"
) -> Footprint:
    """Peak bytes of one training process (see the module docstring); `teacher` is `teacher_bytes(...)`."""
    state = optimizer_state_bytes(settings.optimizer)
    casts = 2 * counts.total if settings.mixed_precision else 0
    if settings.strategy in STRATEGIES and settings.strategy != "ddp":
        sharded = estimate_memory(counts, settings.strategy, settings.processes)
        weights, gradients = sharded.weights + sharded.working, sharded.gradients * trainable / counts.total
        optimizer = sharded.optimizer * trainable / counts.total * (state + 4) / (ADAMW_STATE_BYTES + 4)
    else:
        weights, gradients, optimizer = 4 * counts.total + casts, 4 * trainable, state * trainable
    activations = activation_bytes(config, settings)
    return Footprint(weights, gradients, optimizer, activations, teacher, OVERHEAD.get(device, OVERHEAD["cuda"]))


def teacher_bytes(config, parameters: int, bytes_per_parameter: int, tokens: int) -> float:
    """The teacher's weights (`parameters` of them) and the logits of one micro-batch it keeps for the loss."""
    return parameters * bytes_per_parameter + tokens * config.vocab_size * 4


def local_processes() -> int:
    """Training processes started on this machine (torchrun, accelerate); 1 without a launcher."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

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

ZeRO and FSDP shard the model states as `memory.estimate_memory` says. The per-token layer terms count the tensors
autograd saves in a LLaMA layer with token-choice experts (norm inputs and outputs, q/k/v after RoPE, attention
output, each selected expert's input rows, gate/up outputs, activation and product). The estimate is checked against
measured peaks by `benchmarks/training_memory.py` (docs/training.md, "Memory").
"""

import dataclasses
import math
import os

from .memory import STRATEGIES, ParameterCounts, estimate_memory

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


def available_bytes(device: str) -> float:
    """Free memory where the run will live: the GPU's (device `cuda:i`), else the host's (MemAvailable, within a
    cgroup's limit where one is set)."""
    if device.startswith("cuda"):
        import torch

        return float(torch.cuda.mem_get_info(torch.device(device))[0])
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable"))
    return float(min(available, _cgroup_free()))


def _cgroup_free() -> float:
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as current:
            text = limit.read().strip()
            return math.inf if text == "max" else int(text) - int(current.read())
    except (OSError, ValueError):
        return math.inf


def local_processes() -> int:
    """Training processes started on this machine (torchrun, accelerate); 1 without a launcher."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

"""The training recipes' memory preflight: before the model loads, estimate the run's peak (`footprint`) and, where
it exceeds the free memory, stop with one line naming the estimate, what is free and the flags that would fit.
`--force true` runs anyway."""

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path

from ..footprint import (
    GIB,
    HEADROOM,
    RunSettings,
    available_bytes,
    estimate_footprint,
    local_processes,
    teacher_bytes,
)

logger = logging.getLogger(__name__)
HALF_DTYPES = ("bfloat16", "float16", "torch.bfloat16", "torch.float16")  # a teacher loads in its own dtype


def checkpointing(values) -> bool:
    """Activation checkpointing as TrainingArguments resolves it: `activation_checkpointing`, else its deprecated
    alias `gradient_checkpointing` (which TRL's configs turn on by default)."""
    if getattr(values, "activation_checkpointing", None) is not None:
        return bool(values.activation_checkpointing)
    return bool(getattr(values, "gradient_checkpointing", False))


def sharding(values) -> str:
    """How the run shards model states: "zero2" / "zero3" (DeepSpeed's ZeRO stage in `--deepspeed` or accelerate's
    DeepSpeed config file), "fsdp2" (`--fsdp` or accelerate's FSDP), else "ddp" (a full copy per process)."""
    deepspeed = getattr(values, "deepspeed", None) or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if deepspeed:
        config = deepspeed if isinstance(deepspeed, dict) else json.loads(Path(deepspeed).read_text())
        stage = int((config.get("zero_optimization") or {}).get("stage", 0))
        return "zero3" if stage == 3 else "zero2" if stage else "ddp"
    if getattr(values, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return "fsdp2"
    return "ddp"


def run_settings(values, seq_len: int) -> RunSettings:
    """The settings of the parsed values (an argparse namespace of TrainingArguments fields)."""
    return RunSettings(
        batch=values.per_device_train_batch_size,
        seq_len=seq_len,
        checkpointing=checkpointing(values),
        optimizer=str(getattr(values, "optim", "adamw_torch")),
        mixed_precision=bool(getattr(values, "bf16", False) or getattr(values, "fp16", False)),
        accumulation=values.gradient_accumulation_steps,
        strategy=sharding(values),
        processes=int(os.environ.get("WORLD_SIZE", "1")),  # what ZeRO and FSDP shard over
    )


def device_of(values) -> str:
    import torch

    if getattr(values, "use_cpu", False) or not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"


def trainable_parameters(model, values) -> int:
    """Parameters the run updates on the meta-device `model`: all, the MoE blocks only, all but the routers, or
    LoRA's adapters (rank x (in + out) per targeted matrix)."""
    from .freezing import freeze_routers, train_moe_only

    if getattr(values, "use_peft", False):
        return _lora_parameters(model, values)
    if getattr(values, "train_moe_only", False):
        return train_moe_only(model)
    total = sum(p.numel() for p in model.parameters())
    return total - (freeze_routers(model) if getattr(values, "freeze_routers", False) else 0)


def _lora_parameters(model, values) -> int:
    modules = set(values.lora_target_modules or [])
    names = tuple(values.lora_target_parameters or [])
    count = 0
    for name, parameter in model.named_parameters():
        shape = parameter.shape
        if names and name.endswith(names) and len(shape) == 3:  # fused experts [E, out, in]
            count += values.lora_r * (shape[1] + shape[2]) * shape[0]
        elif name.endswith(".weight") and name.rsplit(".", 2)[-2] in modules and len(shape) == 2:
            count += values.lora_r * (shape[0] + shape[1])
    return count


def suggestions(fits, settings: RunSettings) -> tuple[list[str], RunSettings] | None:
    """The fewest flags, tried in order, after which `fits(settings)` holds; None if none does. The global batch is
    kept: a smaller micro-batch takes more accumulation steps."""
    flags: dict[str, str] = {}
    if not settings.checkpointing:
        settings, flags["--activation_checkpointing"] = dataclasses.replace(settings, checkpointing=True), "true"
        if fits(settings):
            return _flags(flags), settings
    while settings.batch > 1:
        batch = settings.batch // 2
        accumulation = settings.accumulation * settings.batch // batch
        settings = dataclasses.replace(settings, batch=batch, accumulation=accumulation)
        flags["--per_device_train_batch_size"], flags["--gradient_accumulation_steps"] = str(batch), str(accumulation)
        if fits(settings):
            return _flags(flags), settings
    if "adafactor" not in settings.optimizer:
        settings, flags["--optim"] = dataclasses.replace(settings, optimizer="adafactor"), "adafactor"
        if fits(settings):
            return _flags(flags), settings
    return None


def _flags(flags: dict) -> list[str]:
    return [f"{flag} {value}" for flag, value in flags.items()]


def estimate_run(config, values, seq_len: int, teacher=None):
    """(the run's `Footprint`, the free bytes it may use, its settings, a function estimating other settings).
    `teacher` is (its config, bytes per parameter)."""
    from ..footprint import meta_model, parameter_counts

    model = meta_model(config)
    counts, trainable = parameter_counts(config, model), trainable_parameters(model, values)
    settings, device = run_settings(values, seq_len), device_of(values)
    share = local_processes() if device == "cpu" else 1  # CPU processes of one machine share its memory
    free = available_bytes(device) / share

    taught_parameters = parameter_counts(teacher[0]).total if teacher else 0

    def estimate(candidate: RunSettings):
        tokens = candidate.batch * candidate.seq_len
        taught = teacher_bytes(teacher[0], taught_parameters, teacher[1], tokens) if teacher else 0.0
        return estimate_footprint(counts, trainable, config, candidate, taught, device.split(":")[0])

    return estimate(settings), free, settings, estimate


def check_memory(config, values, seq_len: int, teacher=None) -> None:
    """One ValueError when the run's estimated peak exceeds the free memory (`values.force`: a warning instead);
    arguments as `estimate_run`'s."""
    footprint, free, settings, estimate = estimate_run(config, values, seq_len, teacher)
    logger.info("Estimated peak memory of one training process: %s; %.1f GiB free.", footprint.describe(), free / GIB)
    if footprint.total <= HEADROOM * free:
        return
    found = suggestions(lambda candidate: estimate(candidate).total <= HEADROOM * free, settings)
    device = device_of(values)
    where = "on this machine" if device == "cpu" else f"on {device}"
    message = f"this run needs about {footprint.describe()} at its peak and {free / GIB:.1f} GiB is free {where}"
    if found:
        message += f": add {' '.join(found[0])} (about {estimate(found[1]).total / GIB:.1f} GiB)"
    else:
        message += ": no batch size, checkpointing or optimizer setting fits; use more GPUs (ZeRO-3/FSDP) or LoRA"
    if getattr(values, "force", False):
        logger.warning("%s; running anyway (--force).", message)
        return
    raise ValueError(message + ", or --force true to run anyway.")


def check_recipe_memory(model, seq_len: int, teacher: str | None, *options) -> None:
    """`check_memory` for a recipe about to load `model` (a folder, Hub id or `default`, or the config of a model it
    builds): `options` are its parsed dataclasses (TrainingArguments and the recipe's own; later ones win),
    `teacher` the distillation teacher."""
    from transformers import AutoConfig

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

    from ..loading import model_folder
    from .distill import teacher_config

    values = {}
    for group in options:
        values |= group.to_dict() if hasattr(group, "to_dict") else dataclasses.asdict(group)
    config = AutoConfig.from_pretrained(model_folder(model)) if isinstance(model, str) else model
    taught = None
    if teacher is not None:
        theirs = teacher_config(teacher)
        half = not str(teacher).endswith(".gguf") and str(getattr(theirs, "dtype", None)) in HALF_DTYPES
        taught = (theirs, 2 if half else 4)
    check_memory(config, argparse.Namespace(**values), seq_len, taught)

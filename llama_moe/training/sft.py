"""Supervised fine-tuning of a converted MoE with TRL's SFTTrainer, one stage per recipe file (LLaMA-MoE v2's
two-stage instruction tuning: general conversation, then math and code with a replay share of stage 1's data).

The options are exactly `trl sft`'s (`ScriptArguments`, `SFTConfig`, `ModelConfig`, `DatasetMixtureConfig`: the
same YAML file runs under `trl sft --config`) plus `MoESFTArguments`. The replay share is TRL's dataset `fraction`.
SFTTrainer adds the router load-balancing loss (and logs it as `aux_loss`); the other router losses are attached to
the graph by the modeling code. The output is a complete checkpoint whose card lists every stage so far.
`distill: gkd | on_policy` distils from a teacher with TRL's distillation trainers instead (`sft_distill.py`).
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..footprint import FORCE_HELP
from .checkpoint import TrainingOutcome, save_complete_checkpoint, stage_record, unwrapped
from .distill import check_teacher, load_teacher, resolve_teacher, teacher_name
from .freezing import freeze_routers
from .lora import ADAPTER_FOLDER, is_peft_model, lora_config, save_adapter_and_merge
from .memory_check import check_recipe_memory
from .resume import ResumableCheckpointsMixin, resume_checkpoint

DISTILL_CHOICES = ("none", "gkd", "on_policy")


@dataclass
class MoESFTArguments:
    freeze_routers: bool = field(default=False, metadata={"help": "keep every router's weights fixed"})
    distill: str = field(
        default="none",
        metadata={
            "help": "none: SFTTrainer; gkd: TRL's GKD (KD on the chats, on the student's own completions for a "
            "fraction lmbda of the steps); on_policy: TRL's DistillationTrainer (the student completes the prompts)",
            "choices": list(DISTILL_CHOICES),
        },
    )
    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "distillation teacher (default: the dense model the student was converted from, as its "
            "moe_recipe.yaml records it; none: no distillation)"
        },
    )
    beta: float | None = field(
        default=None,
        metadata={
            "help": "generalized JSD: 0 forward KL, 0.5 JSD, 1 reverse KL (default: TRL's, 0.5 gkd, 1 on_policy)"
        },
    )
    temperature: float | None = field(
        default=None,
        metadata={"help": "sampling temperature, and on_policy the loss's (default: TRL's, 0.9 gkd, 1 on_policy)"},
    )
    lmbda: float | None = field(
        default=None, metadata={"help": "gkd: share of steps on the student's own completions (default: 0.5)"}
    )
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "tokens per generated completion (default: TRL's, 128 gkd, 512 on_policy)"}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "start at step 0 and remove the checkpoints an earlier run left in output_dir (default: resume "
            "from the newest complete one)"
        },
    )
    lora_train_routers: bool = field(
        default=False,
        metadata={"help": "with use_peft: train the routers in full (saved with the adapter) instead of freezing them"},
    )
    force: bool = field(default=False, metadata={"help": FORCE_HELP})


def dataset_name(path: str, data_files=None) -> str:
    """A dataset's name for the card: a Hub name as it is; for local data the last two parts of its (first) file's
    path, never the full local path."""
    files = data_files if data_files is not None else (path if Path(path).exists() else None)
    if files is None:
        return path
    while not isinstance(files, str):  # a list of files, or a split -> files mapping
        files = next(iter(files.values() if isinstance(files, dict) else files))
    return "/".join(Path(files).parts[-2:])


def mixture_shares(dataset_args) -> dict[str, float | None]:
    """Each dataset's share of the mixture (TRL's normalised `fraction`), or None where the full dataset is used."""
    fractions = [config.fraction for config in dataset_args.datasets]
    total = sum(f for f in fractions if f is not None)
    return {
        dataset_name(c.path, c.data_files): (c.fraction / total if c.fraction is not None else None)
        for c in dataset_args.datasets
    }


def data_shares(script_args, dataset_args) -> dict[str, float | None]:
    """Each dataset of a stage and its share: the mixture's (`datasets`), or the one `dataset_name`."""
    if dataset_args.datasets:
        return mixture_shares(dataset_args)
    return {dataset_name(script_args.dataset_name): 1.0}


def _load_data(script_args, training, dataset_args) -> tuple:
    """(the stage's dataset splits, each dataset's share)."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError
    from trl import get_dataset

    if not dataset_args.datasets and not script_args.dataset_name:
        raise ValueError("Give the training data: `datasets` in the recipe file, or --dataset_name.")
    datasets_logger = logging.getLogger("datasets")
    level, datasets_logger.level = datasets_logger.level, logging.CRITICAL  # its parse errors: ours below, once
    try:
        if dataset_args.datasets:
            dataset = get_dataset(dataset_args)
        else:
            dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        shares = data_shares(script_args, dataset_args)
    except DatasetGenerationError as error:  # e.g. a line that is not JSON: say which data and row
        names = [dataset_name(c.path, c.data_files) for c in dataset_args.datasets] or [script_args.dataset_name]
        raise ValueError(f"Cannot read the training data ({', '.join(names)}): {error.__cause__ or error}") from None
    finally:
        datasets_logger.setLevel(level)
    evaluate = training.eval_strategy != "no"
    for split in [script_args.dataset_train_split] + ([script_args.dataset_test_split] if evaluate else []):
        if split not in dataset:
            raise ValueError(f"The data has no {split!r} split (it has {', '.join(dataset)}); see test_split_size.")
    return dataset, shares


def build_sft_trainer(script_args, training, model_args, dataset_args, moe: MoESFTArguments):
    """The model (routers frozen if asked), the data mixture and TRL's trainer for one stage (SFTTrainer, or a
    distillation trainer); returns the trainer and what the stage record needs: each dataset's share, the examples
    before packing, the model's `output_router_logits` as loaded (TRL switches it on for the balance loss) and the
    distillation settings."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

    from ..checkpoints.folder import read_tokenizer
    from .distributed import start_deepspeed_comm

    source, trust = model_args.model_name_or_path, training.trust_remote_code
    teacher = resolve_teacher(source, moe.teacher_model_name_or_path) if moe.distill != "none" else None
    if teacher is not None:  # before any model loads
        check_teacher(source, teacher)
    check_recipe_memory(source, training.max_length or 1024, teacher, training, model_args, moe)
    dataset, shares = _load_data(script_args, training, dataset_args)
    dtype = model_args.dtype if model_args.dtype not in (None, "auto") else torch.float32
    tokenizer = read_tokenizer(source, trust_remote_code=trust)  # before the model: a broken one fails at once
    start_deepspeed_comm(training)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust)
    as_loaded = {"output_router_logits": getattr(model.config, "output_router_logits", None)}
    if moe.freeze_routers:
        freeze_routers(model)
    train = dataset[script_args.dataset_train_split]
    evaluation = dataset[script_args.dataset_test_split] if training.eval_strategy != "no" else None
    stage = {"shares": shares, "examples": len(train), "as_loaded": as_loaded, "distillation": None}
    peft_config = lora_config(model_args, model, moe.lora_train_routers)
    if teacher is None:
        trainer = _recipe_trainer(SFTTrainer)(
            model=model,
            args=training,
            train_dataset=train,
            eval_dataset=evaluation,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        return trainer, stage
    trainer = _distillation_trainer(moe, model, teacher, training, train, evaluation, tokenizer)
    stage["distillation"] = _distillation_record(moe, teacher, trainer.args)
    return trainer, stage


def _recipe_trainer(trainer_class):
    """`trainer_class` with checkpoints a killed run can resume from (`resume.ResumableCheckpointsMixin`) and FSDP on
    CPU processes too (`distributed.DistributedTrainingMixin`)."""
    from .distributed import (
        DistributedTrainingMixin,
    )  # imports transformers: this module stays light for the recipe's preflight

    return type(trainer_class.__name__, (DistributedTrainingMixin, ResumableCheckpointsMixin, trainer_class), {})


def _distillation_trainer(moe: MoESFTArguments, model, teacher: str, training, train, evaluation, tokenizer):
    from .sft_distill import distillation_config, distillation_trainer

    if training.router_aux_loss_coef is not None:  # SFTConfig's field, which DistillationConfig lacks
        model.config.router_aux_loss_coef = training.router_aux_loss_coef
    settings = {"beta": moe.beta, "temperature": moe.temperature}
    if moe.distill == "gkd":
        settings |= {"lmbda": moe.lmbda, "max_new_tokens": moe.max_new_tokens}
    else:
        settings["max_completion_length"] = moe.max_new_tokens
    config = distillation_config(training, moe.distill, **settings)
    return distillation_trainer(
        moe.distill, model, load_teacher(teacher, config.device), config, train, evaluation, tokenizer
    )


def _distillation_record(moe: MoESFTArguments, teacher: str, config) -> dict:
    """The settings the trainer ran with (TRL's defaults filled in)."""
    record = {"method": moe.distill, "teacher": teacher_name(teacher), "beta": config.beta}
    record["temperature"] = config.temperature
    if moe.distill == "gkd":
        record |= {"lmbda": config.lmbda, "max_new_tokens": config.max_new_tokens}
    else:
        record["max_new_tokens"] = config.max_completion_length
    return record


def run_sft(script_args, training, model_args, dataset_args, moe: MoESFTArguments) -> TrainingOutcome:
    """One SFT stage; writes the checkpoint to `training.output_dir`."""
    trainer, stage = build_sft_trainer(script_args, training, model_args, dataset_args, moe)
    checkpoint = resume_checkpoint(training, start_over=moe.overwrite_output_dir)  # after the data were read
    metrics = trainer.train(resume_from_checkpoint=checkpoint).metrics
    source = model_args.model_name_or_path
    output, lora = Path(training.output_dir).resolve(), None
    if is_peft_model(unwrapped(trainer)):
        adapter = output.with_name(f".{output.name}.{ADAPTER_FOLDER}")
        lora = save_adapter_and_merge(trainer, source, adapter)
    model = unwrapped(trainer)
    if stage["as_loaded"]["output_router_logits"] is not None:  # inference does not need router logits
        model.config.output_router_logits = stage["as_loaded"]["output_router_logits"]
    record = stage_record(
        trainer,
        "sft",
        stage["shares"],
        source,
        examples=stage["examples"],
        packing=getattr(trainer.args, "packing", False),  # DistillationTrainer does not pack
        freeze_routers=moe.freeze_routers,
        distillation=stage["distillation"],
        lora=lora,
        final_train_loss=round(metrics["train_loss"], 4),
    )
    extra = {ADAPTER_FOLDER: adapter} if lora else None
    output = save_complete_checkpoint(trainer, trainer.processing_class, training.output_dir, source, record, extra)
    return TrainingOutcome(model, metrics, output, trainer.state.log_history)

"""Continual pre-training of a converted MoE on a mixture of domains (LLaMA-MoE v1, section 3).

Packed causal-LM blocks from each domain, each block's domain drawn by the sampling weights: static (given, or a
preset) or dynamic (Sheared-LLaMA's dynamic batch loading against per-domain reference losses). The router
load-balancing loss is on (`router_aux_loss_coef`, 0.01 as in the paper). Held-out perplexity per domain is evaluated
on the trainer's schedule (`eval_strategy`), logged with the domain weights, and stated in the checkpoint's card.
With `distill_alpha` (or `distill_hidden_weight`) above 0 the student also learns from a teacher, by default the dense
model it was converted from (`distill.py` has the loss).
"""

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from ..footprint import FORCE_HELP
from .checkpoint import TrainingOutcome, save_complete_checkpoint, stage_record, unwrapped
from .distill import HIDDEN_LOSSES, DistillationMixin, Distiller, checked_teacher, load_teacher, teacher_name
from .distributed import BalanceLossWeightMixin, DistributedTrainingMixin, start_deepspeed_comm
from .freezing import train_moe_only, train_routers_only
from .memory_check import check_recipe_memory
from .mixture import (
    PRESET_REFERENCE_LOSSES,
    DomainMixture,
    DomainWeights,
    load_domain,
    named_values,
    parse_pairs,
    resolve_weights,
)
from .resume import ResumableCheckpointsMixin, resume_checkpoint
from .sampling import DynamicDomainSampling, domain_losses

logger = logging.getLogger(__name__)
MIXTURE_STATE = "domain_mixture.json"  # in each checkpoint: the sampling weights in force at every draw so far


@dataclass
class ContinualPretrainArguments:
    model_name_or_path: str = field(
        metadata={
            "help": "checkpoint folder or Hub id to train: a converted MoE, or a dense model (teacher correction); "
            "`default` is the built-in dense model"
        }
    )
    domains: list[str] = field(metadata={"help": "NAME=PATH per domain (text/JSON lines/parquet file or folder)"})
    held_out: list[str] | None = field(
        default=None, metadata={"help": "NAME=PATH held-out text per domain (default: held_out_fraction of it)"}
    )
    held_out_fraction: float = field(default=0.05, metadata={"help": "documents held out when no held_out path"})
    eval_blocks: int = field(default=16, metadata={"help": "held-out blocks per domain used for evaluation"})
    domain_weights: list[str] | None = field(
        default=None, metadata={"help": "NAME=WEIGHT per domain, or a preset name: uniform (default), llama"}
    )
    sampling: str = field(default="static", metadata={"help": "static or dynamic", "choices": ["static", "dynamic"]})
    reference_losses: list[str] | None = field(
        default=None, metadata={"help": "dynamic: NAME=LOSS per domain, or the preset llama2-7b-slimpajama"}
    )
    reference_model: str | None = field(
        default=None, metadata={"help": "dynamic: take each domain's reference loss from this (dense) model"}
    )
    update_steps: int = field(default=50, metadata={"help": "dynamic: steps between weight updates"})
    dynamic_step_size: float = field(default=1.0, metadata={"help": "dynamic: step size on the excess loss"})
    dynamic_smoothing: float = field(default=1e-4, metadata={"help": "dynamic: mixing with uniform weights"})
    seq_len: int = field(default=1024, metadata={"help": "tokens per training block"})
    text_column: str | None = field(default=None, metadata={"help": "text field of JSON/parquet rows"})
    router_aux_loss_coef: float = field(default=0.01, metadata={"help": "weight of the load-balancing loss"})
    train_moe_only: bool = field(
        default=False,
        metadata={
            "help": "train only the MoE blocks (experts, routers, shared experts, compensation); attention, norms, "
            "embeddings and the LM head keep the source model's weights"
        },
    )
    train_routers_only: bool = field(
        default=False,
        metadata={
            "help": "train only the MLP routers (mlp.gate.*): a router-only MiX stage on a merged model (BTX's own trains every weight)"
        },
    )
    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "distillation teacher: folder, Hub id or .gguf (default: the dense model the student was "
            "converted from, as its moe_recipe.yaml records it; none: no distillation)"
        },
    )
    distill_alpha: float = field(
        default=0.0,
        metadata={"help": "weight of the KL term: (1 - alpha) * LM + alpha * T^2 * KL + router loss (0: no teacher)"},
    )
    distill_temperature: float = field(default=1.0, metadata={"help": "softmax temperature T of the KL term"})
    distill_top_k: int | None = field(
        default=None,
        metadata={"help": "KL over the teacher's top k tokens plus one bucket for the rest (default: all tokens)"},
    )
    distill_hidden_layers: list[int] | None = field(
        default=None,
        metadata={
            "help": "hidden states matched with the teacher's: 0 the embeddings, i layer i's output, -1 the last"
        },
    )
    distill_hidden_weight: float = field(default=0.0, metadata={"help": "weight of the hidden-state distance"})
    distill_hidden_loss: str = field(
        default="cosine", metadata={"help": "hidden-state distance", "choices": list(HIDDEN_LOSSES)}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "start at step 0 and remove the checkpoints an earlier run left in output_dir (default: resume "
            "from the newest complete one)"
        },
    )
    force: bool = field(default=False, metadata={"help": FORCE_HELP})

    def __post_init__(self):
        from ..loading import DEFAULT_MODEL, model_folder

        if self.model_name_or_path == DEFAULT_MODEL:  # its folder; the card and history name the folder, not the path
            self.model_name_or_path = str(model_folder(DEFAULT_MODEL))
        self.check()

    def check(self) -> None:
        """One ValueError for the first impossible value among these settings (the recipe then checks them against
        its TrainingArguments and the model, before anything loads)."""
        if not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be between 0 and 1, got {self.held_out_fraction}.")
        if self.eval_blocks < 1 or self.seq_len < 2:
            raise ValueError(f"eval_blocks must be >= 1 and seq_len >= 2, got {self.eval_blocks} and {self.seq_len}.")
        if self.train_moe_only and self.train_routers_only:
            raise ValueError("train_moe_only and train_routers_only exclude each other: choose one.")
        if not 0 <= self.distill_alpha <= 1 or self.distill_temperature <= 0 or self.distill_hidden_weight < 0:
            raise ValueError(
                "distill_alpha must be in [0, 1], distill_temperature above 0 and distill_hidden_weight at least 0; "
                f"got {self.distill_alpha}, {self.distill_temperature} and {self.distill_hidden_weight}."
            )
        if self.distill_top_k is not None and self.distill_top_k < 1:
            raise ValueError(f"distill_top_k must be at least 1 (or unset for all tokens), got {self.distill_top_k}.")
        if self.distill_hidden_weight and not self.distill_hidden_layers:
            raise ValueError(
                "distill_hidden_weight needs distill_hidden_layers (indices of the hidden states to match)."
            )
        if self.distill_hidden_loss not in HIDDEN_LOSSES:
            choices = ", ".join(HIDDEN_LOSSES)
            raise ValueError(f"distill_hidden_loss must be one of {choices}, got {self.distill_hidden_loss!r}.")


class MixtureTrainer(
    DistributedTrainingMixin, BalanceLossWeightMixin, ResumableCheckpointsMixin, DistillationMixin, Trainer
):
    """Logs the domain weights (and the held-out losses behind a dynamic update) with the training loss, and
    evaluates the language-model loss alone (no router loss in the held-out perplexity); distils from a teacher
    when given a `distiller`."""

    def __init__(self, *args, mixture: DomainMixture, sampling: DynamicDomainSampling | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.mixture, self.sampling = mixture, sampling

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs or "learning_rate" in logs:
            logs.update({f"domain_weight/{n}": round(w, 4) for n, w in self.mixture.weights.as_dict().items()})
            if self.sampling is not None and self.sampling.last_losses is not None:
                names = self.mixture.weights.names
                logs.update({f"domain_loss/{n}": round(float(x), 4) for n, x in zip(names, self.sampling.last_losses)})
        super().log(logs, *args, **kwargs)

    def save_extra_state(self, folder: Path) -> None:
        (folder / MIXTURE_STATE).write_text(json.dumps(self.mixture.state_dict()) + "\n")

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if hasattr(self.model.config, "output_router_logits"):
            inputs = {**inputs, "output_router_logits": False}
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)


def continual_pretrain(args: ContinualPretrainArguments, training: TrainingArguments) -> TrainingOutcome:
    """Train `args.model_name_or_path` on the domain mixture; writes a complete checkpoint to `training.output_dir`.
    The outcome's metrics are the held-out loss and perplexity per domain."""
    from transformers import AutoModelForCausalLM

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

    from ..checkpoints.folder import read_tokenizer

    _check(args, training)
    teacher = _teacher(args, training)
    check_recipe_memory(args.model_name_or_path, args.seq_len, teacher, training, args)
    tokenizer = read_tokenizer(args.model_name_or_path)
    domains = load_domains(args, tokenizer)
    names = [domain.name for domain in domains]
    weights = DomainWeights(names, resolve_weights(args.domain_weights, names))
    sampling = _dynamic_sampling(args, training, domains, weights) if args.sampling == "dynamic" else None
    start_deepspeed_comm(training)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    output_router_logits = getattr(model.config, "output_router_logits", None)
    if output_router_logits is not None:  # an MoE: train with the balance loss
        model.config.router_aux_loss_coef = args.router_aux_loss_coef
        model.config.output_router_logits = args.router_aux_loss_coef > 0
    if args.train_moe_only:
        logger.info("Training the MoE blocks only: %d parameters.", train_moe_only(model))
    if args.train_routers_only:
        logger.info("Training the routers only: %d parameters.", train_routers_only(model))
    mixture = DomainMixture(domains, weights, seed=training.seed)
    checkpoint = resume_checkpoint(training, start_over=args.overwrite_output_dir)
    if checkpoint is not None:
        mixture.load_state_dict(_mixture_state(checkpoint))
    trainer = MixtureTrainer(
        model=model,
        args=training,
        train_dataset=mixture,
        eval_dataset=_evaluation_sets(domains, args.eval_blocks),
        mixture=mixture,
        sampling=sampling,
        callbacks=[sampling] if sampling else None,
        distiller=_distiller(args, teacher, training.device) if teacher else None,
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    results = _results(trainer.evaluate(), names)
    if output_router_logits is not None:  # as loaded: inference does not need router logits
        model.config.output_router_logits = output_router_logits
    record = _stage(trainer, args, mixture, results, teacher)
    output = save_complete_checkpoint(trainer, tokenizer, training.output_dir, args.model_name_or_path, record)
    return TrainingOutcome(unwrapped(trainer), results, output, trainer.state.log_history)


def _mixture_state(checkpoint: str) -> dict:
    path = Path(checkpoint) / MIXTURE_STATE
    if not path.is_file():
        raise ValueError(f"{checkpoint} has no {MIXTURE_STATE}: it was not written by this recipe.")
    return json.loads(path.read_text())


def _teacher(args: ContinualPretrainArguments, training: TrainingArguments) -> str | None:
    """The teacher to distil from (None: no distillation), checked before any model loads."""
    teacher = checked_teacher(args)
    if teacher is not None and (training.deepspeed or training.fsdp):
        raise ValueError(
            "Distillation loads the whole teacher in every process (one process or DDP); it is not set up for "
            "ZeRO/FSDP sharding: launch with torchrun or recipes/accelerate/ddp.yaml."
        )
    return teacher


def _hidden_layers(args: ContinualPretrainArguments) -> tuple[int, ...]:
    return tuple(args.distill_hidden_layers or ()) if args.distill_hidden_weight else ()


def _distiller(args: ContinualPretrainArguments, teacher: str, device) -> Distiller:
    return Distiller(
        load_teacher(teacher, device),
        alpha=args.distill_alpha,
        temperature=args.distill_temperature,
        top_k=args.distill_top_k,
        hidden_layers=_hidden_layers(args),
        hidden_weight=args.distill_hidden_weight,
        hidden_loss=args.distill_hidden_loss,
    )


def _distillation_record(args: ContinualPretrainArguments, teacher: str | None) -> dict | None:
    if teacher is None:
        return None
    record = {"teacher": teacher_name(teacher), "alpha": args.distill_alpha}
    record |= {"temperature": args.distill_temperature, "top_k": args.distill_top_k}
    if args.distill_hidden_weight:
        record |= {"hidden_layers": list(_hidden_layers(args)), "hidden_weight": args.distill_hidden_weight}
        record["hidden_loss"] = args.distill_hidden_loss
    return record


def _stage(trainer, args: ContinualPretrainArguments, mixture: DomainMixture, results: dict, teacher) -> dict:
    """The history record of this stage: data shares, tokens, sampling, distillation settings, results."""
    training = trainer.args
    global_batch = training.per_device_train_batch_size * training.gradient_accumulation_steps * training.world_size
    shares = mixture.drawn / max(1, mixture.drawn.sum())
    return stage_record(
        trainer,
        "continual-pretraining",
        {name: float(share) for name, share in zip(mixture.weights.names, shares)},
        args.model_name_or_path,
        tokens=trainer.state.global_step * global_batch * args.seq_len,
        sampling=args.sampling,
        final_domain_weights=mixture.weights.as_dict(),
        seq_len=args.seq_len,
        eval_blocks=args.eval_blocks,
        trained=_trained(args),
        distillation=_distillation_record(args, teacher),
        results=results,
    )


def _trained(args: ContinualPretrainArguments) -> str:
    return "routers" if args.train_routers_only else "moe-blocks" if args.train_moe_only else "all"


def _check(args: ContinualPretrainArguments, training: TrainingArguments) -> None:
    """The settings against the TrainingArguments and the model (each alone: `ContinualPretrainArguments.check`)."""
    args.check()  # the fields may have been set after the dataclass was built
    if training.dataloader_num_workers:  # workers would sample from copies of the weights and counts
        raise ValueError("The domain mixture samples in the main process: set dataloader_num_workers to 0.")
    if args.reference_model and (training.deepspeed or training.fsdp):
        raise ValueError(
            "--reference_model is evaluated whole in every process; with ZeRO-3/FSDP measure the reference losses "
            "once and pass them as --reference_losses NAME=LOSS ..."
        )
    _check_moe_only(args)


def _check_moe_only(args: ContinualPretrainArguments) -> None:
    """`train_moe_only` / `train_routers_only` on a model of none of our families, refused from its config before
    anything loads."""
    option = "train_routers_only" if args.train_routers_only else "train_moe_only"
    if not getattr(args, option) or not args.model_name_or_path:
        return
    from ..conversion import families  # noqa: F401  (fills FAMILIES)
    from ..conversion.registry import FAMILIES
    from ..loading import model_folder

    model_type = json.loads((model_folder(args.model_name_or_path) / "config.json").read_text()).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{option}: {args.model_name_or_path} is a {model_type} model, not one of {', '.join(FAMILIES)}: "
            f"it has no MoE blocks to train (convert or merge it first, or drop --{option})."
        )


def _evaluation_sets(domains, eval_blocks: int) -> dict:
    """The first `eval_blocks` held-out blocks of each domain: what the held-out results report."""
    from datasets import Dataset

    sets = {}
    for domain in domains:
        blocks = domain.held_out[:eval_blocks].tolist()
        sets[domain.name] = Dataset.from_dict({"input_ids": blocks, "labels": blocks})
    return sets


def _dynamic_sampling(args, training, domains, weights: DomainWeights) -> DynamicDomainSampling:
    """Dynamic sampling steered by the held-out blocks after the reported ones (the same ones when a domain has too
    few), so the reported perplexity is not the quantity the weights were tuned on."""
    steer = []
    for domain in domains:
        extra = domain.held_out[args.eval_blocks : 2 * args.eval_blocks]
        if len(extra) == 0:
            logger.warning("Domain %r: too few held-out blocks to steer sampling apart from evaluation.", domain.name)
        steer.append(extra if len(extra) else domain.held_out[: args.eval_blocks])
    names = [domain.name for domain in domains]
    reference = _reference_losses(args, names, steer, training)
    return DynamicDomainSampling(
        weights, steer, reference, args.update_steps, args.dynamic_step_size, args.dynamic_smoothing
    )


def load_domains(args: ContinualPretrainArguments, tokenizer) -> list:
    """The recipe's domains as `DomainData` (training and held-out blocks), in the order given."""
    paths = parse_pairs(args.domains, "Domains")
    if not paths:
        raise ValueError("Give at least one domain as NAME=PATH (--domains).")
    held_out = parse_pairs(args.held_out, "Held-out data")
    unknown = sorted(set(held_out) - set(paths))
    if unknown:
        raise ValueError(f"Held-out data names unknown domains {unknown}; domains are {sorted(paths)}.")
    return [
        load_domain(name, path, tokenizer, args.seq_len, args.held_out_fraction, held_out.get(name), args.text_column)
        for name, path in paths.items()
    ]


def _reference_losses(args: ContinualPretrainArguments, names: list[str], held_out, training) -> list[float]:
    """Per-domain reference losses: given (or a preset), or measured once with `reference_model`."""
    if args.reference_model is not None:
        from transformers import AutoModelForCausalLM

        import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

        reference = AutoModelForCausalLM.from_pretrained(args.reference_model, dtype=torch.float32)
        losses = domain_losses(reference.to(training.device), held_out, training.per_device_eval_batch_size)
        del reference
        return losses.tolist()
    if args.reference_losses is None:
        raise ValueError("Dynamic sampling needs reference losses: --reference_model or --reference_losses.")
    given = named_values(args.reference_losses, PRESET_REFERENCE_LOSSES, "Reference losses")
    missing = sorted(set(names) - set(given))
    if missing:
        raise ValueError(f"Reference losses are missing for domains {missing}.")
    return [given[name] for name in names]


def _results(metrics: dict, names: list[str]) -> dict:
    results = {}
    for name in names:
        loss = metrics[f"eval_{name}_loss"]
        results[f"{name}_loss"] = round(loss, 4)
        results[f"{name}_perplexity"] = round(math.exp(loss), 2)
    return results

"""Knowledge distillation from a teacher (by default the dense model the MoE was converted from), for any
transformers `Trainer`: continual pre-training on raw text, which TRL's distillation trainers do not cover (they need
prompts). The SFT recipe uses TRL's trainers instead (`sft_distill.py`); both resolve and load the teacher here.

`DistillationMixin.compute_loss`, in training:

    loss = (1 - alpha) * L_LM + c * L_balance + alpha * T^2 * KL_T(teacher || student) + w * D_hidden

`L_LM + c * L_balance` is the model's own loss (`outputs.loss`, with `router_aux_loss_coef` c): the balance loss keeps
its full weight, and the router losses the modeling code attaches to the graph (z-loss, mutual information) are
untouched. KL_T is the forward KL of the next-token distributions at temperature T, summed over the vocabulary and
normalised like the LM loss (over the same tokens, by the trainer's `num_items_in_batch` when it passes one), so
gradient accumulation and token averaging across processes treat both terms alike; T^2 keeps its gradient scale
independent of T (Hinton et al., 2015). D_hidden is the MSE or cosine distance of chosen hidden states, averaged
over those layers and normalised the same way. Evaluation is the LM loss alone.

The teacher runs in eval mode without autograd, in its checkpoint's dtype, on the student's device (one copy per
process under DDP); its parameters never require gradients and are never changed.
"""

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoints.writer import check_weights
from ..distillation import distillation_kl, distillation_objective
from ..preflight import check_training
from .lora import check_lora
from .resume import check_resume

NO_TEACHER = ("", "none")
HIDDEN_LOSSES = ("cosine", "mse")
_DEFAULT_SOURCE_MARK = "(built-in default"  # how conversion_info's source names the built-in default model


def recorded_source(student: str) -> str:
    """The dense model `student` was converted from, as its folder records it: `moe_recipe.yaml`'s `model` (null:
    the built-in default), else `config.conversion_info`'s source. Trained checkpoints carry the recipe forward."""
    from ..conversion.recipe import RECIPE_FILE, load_recipe
    from ..loading import DEFAULT_MODEL, model_folder

    folder = model_folder(student)
    if (folder / RECIPE_FILE).is_file():
        _, run = load_recipe(folder / RECIPE_FILE)
        if "model" in run:
            return run["model"] or DEFAULT_MODEL
    info = json.loads((folder / "config.json").read_text()).get("conversion_info") or {}
    source = str(info.get("source") or "")
    if _DEFAULT_SOURCE_MARK in source:
        return DEFAULT_MODEL
    if source and not any(c.isspace() for c in source):  # a path or a Hub id, not a description
        return source
    raise ValueError(
        f"{student} does not record the dense model it was converted from (no {RECIPE_FILE}, no conversion_info "
        "source): give --teacher_model_name_or_path (or none for no distillation)."
    )


def resolve_teacher(student: str, teacher: str | None) -> str | None:
    """The teacher to load: `teacher` as given, the student's recorded source when None, no teacher for none/""."""
    if teacher is not None and teacher.strip().lower() in NO_TEACHER:
        return None
    return teacher or recorded_source(student)


def teacher_spec(values) -> str | None:
    """The teacher a recipe's options ask for, or None when they do not distil: continual pre-training distils when
    `distill_alpha` or `distill_hidden_weight` is above 0, SFT when `distill` is not none."""
    distilling = (
        getattr(values, "distill", "none") != "none"
        or getattr(values, "distill_alpha", 0) > 0
        or getattr(values, "distill_hidden_weight", 0) > 0
    )
    return resolve_teacher(values.model_name_or_path, values.teacher_model_name_or_path) if distilling else None


def check_training_and_teacher(values) -> None:
    """The recipes' preflight: `preflight.check_training`, `--resume_from_checkpoint`, the SFT recipe's LoRA settings,
    then the distillation teacher against the student (configs only: no model loads)."""
    check_training(values)
    check_resume(values)
    check_lora(values)
    if values.model_name_or_path:
        check_weights(values.model_name_or_path)  # the student's (the teacher's: check_teacher)
    checked_teacher(values)


def checked_teacher(values) -> str | None:
    """`teacher_spec(values)`, checked against the student (`check_teacher`) before any model loads."""
    teacher = teacher_spec(values)
    if teacher is not None:
        hidden = values.distill_hidden_layers if getattr(values, "distill_hidden_weight", 0) else None
        check_teacher(values.model_name_or_path, teacher, hidden)
    return teacher


def teacher_config(spec: str):
    """The teacher's config without loading its weights."""
    from transformers import AutoConfig

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

    from ..loading import model_folder

    if str(spec).endswith(".gguf"):
        return AutoConfig.from_pretrained(Path(spec).parent, gguf_file=Path(spec).name)
    return AutoConfig.from_pretrained(model_folder(spec))


def check_teacher(student: str, spec: str, hidden_layers: list[int] | None = None) -> None:
    """One ValueError, before any model loads, when the teacher cannot teach the student: a different vocabulary
    size, or (with hidden-state matching) a different hidden size or a layer index either lacks."""
    from transformers import AutoConfig

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

    from ..loading import model_folder

    if not str(spec).endswith(".gguf"):
        check_weights(spec)
    ours = AutoConfig.from_pretrained(model_folder(student)).get_text_config()
    theirs = teacher_config(spec).get_text_config()
    if ours.vocab_size != theirs.vocab_size:
        raise ValueError(
            f"The teacher {spec} has a vocabulary of {theirs.vocab_size} tokens and the student {student} one of "
            f"{ours.vocab_size}: distillation compares next-token distributions, so both need the same tokenizer."
        )
    if not hidden_layers:
        return
    if ours.hidden_size != theirs.hidden_size:
        raise ValueError(
            f"distill_hidden_layers: the teacher's hidden size is {theirs.hidden_size}, the student's "
            f"{ours.hidden_size}; hidden states can only be matched at the same width."
        )
    states = min(ours.num_hidden_layers, theirs.num_hidden_layers) + 1  # the embeddings, then each layer's output
    bad = [i for i in hidden_layers if not -states <= i < states]
    if bad:
        raise ValueError(
            f"distill_hidden_layers {bad} out of range: hidden states are indexed {-states}..{states - 1}."
        )


def load_teacher(spec: str, device=None):
    """The teacher in eval mode on `device`, in its checkpoint's dtype (a GGUF file: float32, dequantised), with
    gradients off: it is never trained."""
    from transformers import AutoModelForCausalLM

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

    from ..loading import model_folder

    if str(spec).endswith(".gguf"):
        from ..checkpoints import load_gguf_model

        model = load_gguf_model(spec)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_folder(spec), dtype="auto")
    return model.to(device).eval().requires_grad_(False)


def teacher_name(spec: str) -> str:
    """The teacher as the card and history name it: a Hub id, a folder's (or file's) name, never a local path."""
    from ..checkpoints import DEFAULT_MODEL_HUB_ID
    from ..loading import DEFAULT_MODEL

    if spec == DEFAULT_MODEL:
        return f"{DEFAULT_MODEL_HUB_ID} (built-in default)"
    return Path(spec).name if Path(spec).expanduser().exists() else spec


def hidden_distance(student_states, teacher_states, layers, kind: str = "cosine"):
    """Per-position distance of the hidden states at `layers` (indices into `hidden_states`: 0 the embeddings, i the
    output of layer i, -1 the final norm's), averaged over the layers: [B, T]. Cosine ignores the norm, which grows
    with depth; MSE is averaged over the hidden dimensions."""
    distances = []
    for layer in layers:
        ours, theirs = student_states[layer].float(), teacher_states[layer].float()
        if kind == "mse":
            distances.append((ours - theirs).square().mean(-1))
        else:
            distances.append(1 - F.cosine_similarity(ours, theirs, dim=-1))
    return torch.stack(distances).mean(0)


@dataclass
class Distiller:
    """The teacher and the settings of the distillation term (the module docstring has the loss)."""

    teacher: torch.nn.Module
    alpha: float = 0.5
    temperature: float = 1.0
    top_k: int | None = None
    hidden_layers: tuple[int, ...] = ()
    hidden_weight: float = 0.0
    hidden_loss: str = "cosine"

    def loss(self, model, inputs: dict, router_coef: float, count=None) -> tuple:
        """(training loss, the student's outputs, the unweighted terms for the logs). `count`: the tokens with a label
        in the whole accumulated batch (the trainer's `num_items_in_batch`), None for a mean over this batch."""
        hidden = bool(self.hidden_weight and self.hidden_layers)
        outputs = model(**inputs, output_hidden_states=hidden)
        with torch.no_grad():
            teacher = self.teacher(
                input_ids=inputs["input_ids"],
                attention_mask=inputs.get("attention_mask"),
                output_hidden_states=hidden,
                use_cache=False,
            )
        mask = inputs["labels"][:, 1:] != -100  # the positions that predict a token, as in the LM loss
        count = mask.sum().clamp(min=1) if count is None else count

        def per_token(values):
            return (values * mask).sum() / count

        kl = per_token(distillation_kl(outputs.logits[:, :-1], teacher.logits[:, :-1], self.temperature, self.top_k))
        loss = distillation_objective(outputs, kl, router_coef, self.alpha, self.temperature)
        terms = {"distill_kl": kl.detach()}
        if hidden:
            states = outputs.hidden_states, teacher.hidden_states
            distance = per_token(hidden_distance(*states, self.hidden_layers, self.hidden_loss)[:, :-1])
            loss = loss + self.hidden_weight * distance
            terms["distill_hidden"] = distance.detach()
        return loss, outputs, terms


class DistillationMixin:
    """A distillation term in `compute_loss` for any transformers `Trainer` subclass (list it before the trainer
    among the bases); with `distiller=None`, or in evaluation, the trainer's own loss. Logs the unweighted KL
    (`distill_kl`) and hidden-state distance (`distill_hidden`) next to the loss."""

    def __init__(self, *args, distiller: Distiller | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.distiller, self._distill_terms = distiller, defaultdict(list)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.distiller is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        count = num_items_in_batch if self.model_accepts_loss_kwargs else None  # as Trainer.compute_loss normalises
        if count is not None:
            inputs = {**inputs, "num_items_in_batch": count}
        config = self.accelerator.unwrap_model(model).config
        loss, outputs, terms = self.distiller.loss(model, inputs, getattr(config, "router_aux_loss_coef", 0.0), count)
        for name, value in terms.items():
            self._distill_terms[name].append(value.item())
        if self.args.average_tokens_across_devices and count is not None:  # as Trainer.compute_loss: DDP averages
            loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs and self._distill_terms:
            logs.update({name: round(sum(v) / len(v), 4) for name, v in self._distill_terms.items()})
            self._distill_terms.clear()
        super().log(logs, *args, **kwargs)

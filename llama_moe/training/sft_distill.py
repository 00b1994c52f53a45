"""SFT stages distilled from a teacher with TRL's trainers (`distill:` in the SFT recipe), the MoE's router balance
loss kept in training:

    gkd        trl.experimental.gkd.GKDTrainer: generalized JSD (`beta`: 0 forward KL, 1 reverse KL) on the data's
               chats; a fraction `lmbda` of the steps trains on the student's own completions of their prompts
    on_policy  trl.DistillationTrainer: generalized JSD on completions the student generates for the data's prompts

Both compute the divergence alone and bypass the loss of the model's head: `MoEGKDTrainer` and
`MoEDistillationTrainer` add `router_aux_loss_coef * aux_loss` as SFTTrainer does (per micro-batch, averaged over
the accumulation steps). The z-loss and mutual-information loss are attached to the graph by the modeling code.
"""

import dataclasses
import warnings
from contextlib import contextmanager

with warnings.catch_warnings():  # TRL warns that `trl.experimental` may change: GKD lives there in TRL 1.16
    warnings.simplefilter("ignore")
    from trl.experimental.gkd import GKDConfig, GKDTrainer
from trl import DistillationConfig, DistillationTrainer

from .resume import ResumableCheckpointsMixin


def _accumulation_steps(trainer, num_items_in_batch) -> int:
    """What the aux loss, a per-micro-batch mean, is divided by: SFTTrainer's rule (the trainer leaves gradient
    accumulation to the loss when it counts `num_items_in_batch`)."""
    return trainer.current_gradient_accumulation_steps if num_items_in_batch is not None else 1


class MoEGKDTrainer(ResumableCheckpointsMixin, GKDTrainer):
    """GKD with the student's router balance loss (its forward returns `aux_loss`; GKD's loss ignores it)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        aux = getattr(outputs, "aux_loss", None)
        if self.aux_loss_enabled and aux is not None:
            loss = loss + self.router_aux_loss_coef * aux / _accumulation_steps(self, num_items_in_batch)
            self._metrics["train" if model.training else "eval"]["aux_loss"].append(aux.item())
        return (loss, outputs) if return_outputs else loss


@contextmanager
def _router_logits_recorded(backbone):
    """Asks `backbone` for its router logits while the block runs and records its last call: {"output", "mask"}."""
    call = {}

    def ask(module, args, kwargs):
        return args, {**kwargs, "output_router_logits": True}

    def record(module, args, kwargs, output):
        call.update(output=output, mask=kwargs.get("attention_mask"))

    hooks = [
        backbone.register_forward_pre_hook(ask, with_kwargs=True),
        backbone.register_forward_hook(record, with_kwargs=True),
    ]
    try:
        yield call
    finally:
        for hook in hooks:
            hook.remove()


class MoEDistillationTrainer(ResumableCheckpointsMixin, DistillationTrainer):
    """On-policy distillation with the student's router balance loss: TRL runs the student's backbone directly (no
    head, so no `aux_loss`); the router logits of that call give it."""

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        coef = getattr(unwrapped_student.config, "router_aux_loss_coef", 0.0)
        if not coef or not hasattr(unwrapped_student, "router_aux_loss"):
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        with _router_logits_recorded(unwrapped_student.base_model) as call:
            loss, entropy, tokens = super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        aux = unwrapped_student.router_aux_loss(call["output"], call["mask"])
        if aux is None:  # a family without balance loss (SoapMoE)
            return loss, entropy, tokens
        self._metrics["train" if unwrapped_student.training else "eval"]["aux_loss"].append(aux.item())
        return loss + coef * aux.to(loss.device) / _accumulation_steps(self, num_items_in_batch), entropy, tokens


def distillation_config(training, distill: str, **settings):
    """`training` (an SFTConfig) as the config of the chosen trainer: every field they share keeps its value;
    `settings` (beta, temperature, ...) that are None keep TRL's defaults."""
    target = GKDConfig if distill == "gkd" else DistillationConfig
    names = {field.name for field in dataclasses.fields(target) if field.init}
    shared = {f.name: getattr(training, f.name) for f in dataclasses.fields(training) if f.init and f.name in names}
    if distill == "gkd":
        shared["packing"] = False  # GKD's collator pads whole chats
    return target(**shared, **{name: value for name, value in settings.items() if value is not None})


def as_chats(dataset):
    """Prompt/completion rows as `messages`, the form GKD's collator reads (it takes a `prompt` for text)."""
    if "messages" in dataset.column_names or "completion" not in dataset.column_names:
        return dataset
    return dataset.map(
        lambda row: {"messages": row["prompt"] + row["completion"]}, remove_columns=["prompt", "completion"]
    )


def distillation_trainer(distill: str, model, teacher, config, train, evaluation, tokenizer):
    """The TRL trainer of `distill` (gkd, on_policy) with the router balance loss kept."""
    if tokenizer.pad_token is None:  # GKD's collator pads; DistillationTrainer does the same itself
        tokenizer.pad_token = tokenizer.eos_token
    if distill == "gkd":
        train, evaluation = as_chats(train), None if evaluation is None else as_chats(evaluation)
        trainer_class = MoEGKDTrainer
    else:
        trainer_class = MoEDistillationTrainer
    return trainer_class(
        model=model,
        teacher_model=teacher,
        args=config,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
    )

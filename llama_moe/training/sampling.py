"""Dynamic domain sampling during training: every `update_steps` optimizer steps, measure each domain's held-out
loss and move the sampling weights towards the domains furthest above their reference loss (Sheared-LLaMA's dynamic
batch loading, as LLaMA-MoE v1 uses it)."""

import numpy as np
import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from .mixture import DomainWeights, sheared_llama_update


@torch.no_grad()
def domain_losses(model, held_out: list[torch.Tensor], batch_size: int = 4) -> np.ndarray:
    """Mean next-token loss of `model` on each domain's held-out blocks `[M, L]` (the language-model loss only)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = []
    for blocks in held_out:
        total, count = 0.0, 0
        for start in range(0, len(blocks), batch_size):
            ids = blocks[start : start + batch_size].to(device)
            logits = model(input_ids=ids).logits[:, :-1].float()  # [B, L-1, V]
            total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
            count += ids[:, 1:].numel()
        losses.append(total / count)
    model.train(was_training)
    return np.array(losses)


class DynamicDomainSampling(TrainerCallback):
    """Updates `weights` in place every `update_steps` steps from the held-out losses against `reference`.

    Every process computes the same losses on the same blocks with the same weights, so the weights stay identical
    across processes without communication (with sharded models the forward passes run in step on all ranks)."""

    def __init__(
        self,
        weights: DomainWeights,
        held_out: list[torch.Tensor],
        reference: np.ndarray,
        update_steps: int,
        step_size: float = 1.0,
        smoothing: float = 1e-4,
    ):
        if update_steps < 1:
            raise ValueError(f"update_steps must be at least 1, got {update_steps}.")
        self.weights, self.held_out, self.reference = weights, held_out, np.asarray(reference, dtype=np.float64)
        self.update_steps, self.step_size, self.smoothing = update_steps, step_size, smoothing
        self.last_losses: np.ndarray | None = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.update_steps == 0:
            self.last_losses = domain_losses(model, self.held_out, args.per_device_eval_batch_size)
            self.weights.values = sheared_llama_update(
                self.weights.values, self.last_losses, self.reference, self.step_size, self.smoothing
            )
            control.should_log = True  # record the new weights at the step they change
        return control

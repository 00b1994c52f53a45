"""Router losses besides the Switch load-balancing loss (which the causal-LM head adds from `router_logits`, as
Mixtral's does, and which TRL's trainers compute themselves): the ST-MoE z-loss, the mutual-information loss, and the
balance loss of routers outside `router_logits` (AttnMoE's attention routers).

They go into `loss` when our head computes it (`router_loss_sink`), weighted like the language-model loss so that
they follow gradient accumulation (`router_loss_share`); when another head computes the loss (TRL's fused LM head runs
the backbone alone) they are attached to the autograd graph (`AddAuxiliaryLoss`), so they reach the gradients
whichever trainer computes the loss (docs/modeling.md, "Router losses").

This file is copied next to saved checkpoints (remote code): it imports only torch and transformers.
"""

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils.import_utils import is_torchdynamo_compiling


def router_z_loss_func(router_logits: tuple[torch.Tensor, ...] | None) -> torch.Tensor | int:
    """ST-MoE router z-loss: mean over tokens and routers of logsumexp(logits)^2 (keeps router logits small)."""
    if not router_logits:
        return 0
    return torch.stack([torch.logsumexp(logits.float(), dim=-1).square().mean() for logits in router_logits]).mean()


def router_mi_loss_func(router_logits: tuple[torch.Tensor, ...] | None) -> torch.Tensor | int:
    """Mutual-information router loss (ModuleFormer), mean over routers of `mean_t H(p(.|x_t)) - H(mean_t p(.|x_t))`:
    minus the mutual information between tokens and experts, in [-ln E, 0]. The first entropy falls as each token's
    routing sharpens, the second rises as the batch spreads over the experts."""
    if not router_logits:
        return 0
    return torch.stack([_router_mi_loss(logits) for logits in router_logits]).mean()


def _router_mi_loss(router_logits: torch.Tensor) -> torch.Tensor:
    log_probs = F.log_softmax(router_logits.float(), dim=-1)  # [T, E]
    probs = log_probs.exp()
    token_entropy = -(probs * log_probs).sum(-1).mean()
    mean_probs = probs.mean(0)  # [E]
    # An expert no token reaches at all has mean 0: its term is 0, and the clamp keeps its gradient finite.
    batch_entropy = -(mean_probs * mean_probs.clamp_min(torch.finfo(mean_probs.dtype).tiny).log()).sum()
    return token_entropy - batch_entropy


def router_losses(router_logits: torch.Tensor, z_loss_weight: float, mi_loss_weight: float) -> torch.Tensor | int:
    """The weighted z-loss plus MI loss of one router's `[T, E]` logits; a term whose weight is 0 is not computed."""
    terms = ((z_loss_weight, router_z_loss_func), (mi_loss_weight, router_mi_loss_func))
    return sum(weight * loss_func((router_logits,)) for weight, loss_func in terms if weight)


class AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on `hidden_states` whose backward also sends gradient 1 into `loss` (DeepSeek-V2's design): a loss
    attached this way trains its parameters whatever computes the final loss (our head, TRL's fused head, ...)."""

    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype, ctx.loss_needs_grad = loss.dtype, loss.requires_grad
        return hidden_states.view_as(hidden_states)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_loss = torch.ones((), dtype=ctx.loss_dtype, device=grad_output.device) if ctx.loss_needs_grad else None
        return grad_output, grad_loss


# The router losses of the forward in progress, while a head that computes its own loss collects them. A context
# variable, not a module attribute: each thread (nn.DataParallel replicas) has its own.
_ROUTER_LOSS_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("router_loss_sink", default=None)


@contextlib.contextmanager
def router_loss_sink():
    """Collect the router losses of the forward run inside (a list of scalars) instead of attaching them to the graph:
    the head adds them to `loss`, where a training loop's weighting for gradient accumulation reaches them too."""
    sink = []
    token = _ROUTER_LOSS_SINK.set(sink)
    try:
        yield sink
    finally:
        _ROUTER_LOSS_SINK.reset(token)


def collect_router_losses(forward) -> tuple[object, list]:
    """`forward()` and the router losses it collected (`router_loss_sink`)."""
    with router_loss_sink() as sink:
        return forward(), sink


def attach_router_loss(module: nn.Module, hidden_states: torch.Tensor, loss: torch.Tensor | float) -> torch.Tensor:
    """`hidden_states`, with `loss` attached to the graph when `module` trains with gradients (else unchanged); while a
    head collects the router losses (`router_loss_sink`), `loss` goes there instead."""
    if not (module.training and torch.is_grad_enabled() and torch.is_tensor(loss) and loss.requires_grad):
        return hidden_states
    sink = None if is_torchdynamo_compiling() else _ROUTER_LOSS_SINK.get()  # context variables break the graph
    if sink is not None:
        sink.append(loss)
        return hidden_states
    return AddAuxiliaryLoss.apply(hidden_states, loss.to(hidden_states.device))


def router_loss_share(labels: torch.Tensor, num_items_in_batch=None, shift_labels=None, **_) -> torch.Tensor | float:
    """The weight of a micro-batch's mean router loss in `loss`: its share of the counted label tokens when the
    trainer normalises the language-model loss by `num_items_in_batch` (the tokens of every accumulated micro-batch
    and process; transformers' Trainer then neither divides by the accumulation steps nor averages), else 1."""
    if num_items_in_batch is None:
        return 1.0
    counted = shift_labels if shift_labels is not None else labels[..., 1:]
    return counted.ne(-100).sum() / num_items_in_batch

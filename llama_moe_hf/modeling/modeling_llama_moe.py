"""LlamaMoE: LLaMA with Mixture-of-Experts feed-forward blocks (LLaMA-MoE v1/v2, sparse upcycling, G-MoEfication).

Attention, norms and rotary embeddings are transformers' own modules of the dense source family
(`config.source_model_type`: LLaMA, Mistral, Qwen2, Qwen3, Phi-3), used as they are; only the MoE parts are new:

    routers   one class per gate type (`config.router_type`, `ROUTER_CLASSES`): hidden states [T, H] ->
              (router_logits [T, E], top-k weights [T, k], top-k expert ids [T, k]), in float32; the expert-choice
              router in training gives each expert's tokens instead (weights [E, C], token ids [E, C])
    experts   LlamaMoEExperts: fused weights; `forward` is the plain reference loop (`experts_implementation="eager"`);
              `llama_moe_cpu` (fast CPU dispatch), `llama_moe_cpu_compiled` (its decoding kernel compiled) and
              `llama_moe_auto` (the default, per device) are registered with transformers' experts implementations
              next to its `grouped_mm` and `batched_mm`
    block     LlamaMoESparseMoeBlock: router + experts (+ shared experts, + G-MoEfication compensation)
    layer     LlamaMoEDecoderLayer: LLaMA decoder layer whose MLP is dense or MoE (`config.moe_layers`)
    model     LlamaMoEModel
    heads     LlamaMoEForCausalLM, LlamaMoEForSequenceClassification, LlamaMoEForTokenClassification,
              LlamaMoEForQuestionAnswering

Router losses. The Switch load-balancing loss over `router_logits` is the standard term: the causal-LM head adds
`router_aux_loss_coef * aux_loss` to `loss`, and TRL's trainers compute the same term themselves. Every other router
loss (the z-loss, the mutual-information loss, and the balance loss of routers outside `router_logits`) goes into
`loss` when our head computes it (`router_loss_sink`), weighted like the language-model loss so that it follows
gradient accumulation; when another head computes the loss (TRL's fused LM head runs the backbone alone) it is
attached to the autograd graph (`AddAuxiliaryLoss`), so it reaches the gradients whichever trainer computes the loss.

This file is copied next to saved checkpoints (remote code): it imports only transformers, torch and
`.configuration_llama_moe`.
"""

import contextlib
import contextvars
import functools
import importlib
import math
import os
import warnings
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    batched_mm_experts_forward,
    grouped_mm_experts_forward,
)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.import_utils import is_torchdynamo_compiling
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_llama_moe import LlamaMoEConfig

# transformers 5.24 renamed the cache argument of models, decoder layers, attention and masks, and the cache field of
# model outputs, from `past_key_values` to `cache`. This file follows the new name; `CACHE_ARG` is the name of the
# installed release, for calls into transformers' modules and for output fields, so the same file runs on 5.23 too.
CACHE_ARG = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def accepts_past_key_values(forward):
    """`forward(..., cache=...)` that also takes the cache as `past_key_values=` (what transformers < 5.24 passes).
    On 5.24 and later the old name is deprecated, with the warning transformers' own models give for it."""

    @functools.wraps(forward)
    def wrapper(*args, past_key_values: Cache | None = None, **kwargs):
        if past_key_values is not None and kwargs.get("cache") is None:
            if CACHE_ARG == "cache":
                message = f"`past_key_values` is deprecated for `{forward.__qualname__}`. Use `cache` instead."
                warnings.warn(message, FutureWarning, stacklevel=2)
            kwargs["cache"] = past_key_values
        return forward(*args, **kwargs)

    return wrapper


def output_cache(outputs) -> Cache | None:
    """The cache a model output carries, whichever name the installed transformers gives the field."""
    return outputs.get(CACHE_ARG)


# `llama_moe_cpu`: while no expert gets more than BMM_MAX_ROWS_PER_EXPERT (token, expert) rows and the padded layout
# holds at most BMM_MAX_PADDED_ROWS, one batched matmul over zero-padded per-expert rows beats a loop of small
# per-expert matmuls on CPU. Above ~1000 padded rows its speed depends on the process (16 experts x 256 neurons,
# top-4, 256 tokens: 0.36 to 0.50 of the dense FFN, the loop 0.34 to 0.41; docs/benchmarks.md).
BMM_MAX_ROWS_PER_EXPERT = 128
BMM_MAX_PADDED_ROWS = 1024


# ---------------------------------------------------------------------------------------------------------------
# Router losses
# ---------------------------------------------------------------------------------------------------------------


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


def collect_router_losses(forward) -> tuple[MoeModelOutputWithPast, list]:
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


# ---------------------------------------------------------------------------------------------------------------
# Routers: one class per gate type
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def source_modules(model_type: str) -> tuple[type, type, type]:
    """(attention, RMS norm, rotary embedding) classes of transformers' dense family `model_type`, by its naming
    convention (`Qwen3Model` -> `Qwen3Attention`, `Qwen3RMSNorm`, `Qwen3RotaryEmbedding`): the MoE keeps its source's
    attention exactly, and follows transformers' own changes to it."""
    prefix = MODEL_MAPPING_NAMES.get(model_type, "").removesuffix("Model")
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        return tuple(getattr(module, prefix + part) for part in ("Attention", "RMSNorm", "RotaryEmbedding"))
    except (ImportError, AttributeError):
        raise ValueError(
            f"source_model_type {model_type!r}: the installed transformers has no attention, RMS norm and rotary "
            "embedding modules of that name."
        ) from None


class LlamaMoERouter(nn.Module):
    """Base of the token-choice routers: `weight [E, H]`, logits in float32. Subclasses pick the experts.

    `num_experts` / `top_k` override the config's when something other than the MLP experts is routed (AttnMoE's
    attention-head experts).
    """

    # Whether `forward` returns each expert's chosen tokens (`[E, C]`) rather than each token's experts (`[T, k]`).
    chooses_tokens = False

    def __init__(self, config: LlamaMoEConfig, num_experts: int | None = None, top_k: int | None = None):
        super().__init__()
        self.num_experts = num_experts or config.num_experts
        self.top_k = top_k or config.num_experts_per_tok
        self.hidden_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[T, E]` float32 router logits of `[..., H]` hidden states."""
        states = hidden_states.reshape(-1, self.hidden_dim).float()  # [T, H]
        if states.shape[0] == 1 and states.is_cpu and is_torchdynamo_compiling():
            # A decoding step compiled on CPU: a product and a sum, which inductor fuses with its neighbours, where a
            # matmul is an external call of its own (about 20 us a layer).
            return (states.unsqueeze(-2) * self.weight.float()).sum(-1)
        return F.linear(states, self.weight.float())

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class LlamaMoETopKRouter(LlamaMoERouter):
    """Softmax over all experts, keep the top-k, renormalise them to sum to 1 (Mixtral, LLaMA-MoE)."""

    def forward(self, hidden_states):
        router_logits = self.logits(hidden_states)  # [T, E]
        top_k_logits, top_k_index = torch.topk(router_logits, self.top_k, dim=-1)  # [T, k]
        # The renormalised top-k of a softmax is the softmax of the top-k logits: one small softmax instead of two.
        return router_logits, F.softmax(top_k_logits, dim=-1), top_k_index


class LlamaMoESwitchRouter(LlamaMoERouter):
    """Softmax over all experts, keep the top-k probabilities as they are (the Switch Transformer gate for k = 1)."""

    def forward(self, hidden_states):
        router_logits = self.logits(hidden_states)  # [T, E]
        top_k_weights, top_k_index = torch.topk(F.softmax(router_logits, dim=-1), self.top_k, dim=-1)  # [T, k]
        return router_logits, top_k_weights, top_k_index


class LlamaMoENoisyTopKRouter(LlamaMoETopKRouter):
    """`top_k` on `x W + N(0, 1) * softplus(x W_noise)`; the noise only in training (Shazeer et al., 2017)."""

    def __init__(self, config, num_experts=None, top_k=None):
        super().__init__(config, num_experts, top_k)
        self.noise_weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))

    def logits(self, hidden_states):
        router_logits = super().logits(hidden_states)
        if not self.training:
            return router_logits
        noise_std = F.softplus(F.linear(hidden_states.reshape(-1, self.hidden_dim).float(), self.noise_weight.float()))
        return router_logits + torch.randn_like(router_logits) * noise_std


class LlamaMoESelectorRouter(LlamaMoERouter):
    """MoEfication's expert selector: scores = `Linear(E, E)(tanh(Linear(H, E)(x)))` (`weight`, `bias`,
    `selector.{weight,bias}`); the top-k scores win and every winner gets weight exactly 1 (G-MoEfication), with a
    straight-through gradient through `sigmoid(score)` so that the selector keeps training."""

    def __init__(self, config, num_experts=None, top_k=None):
        super().__init__(config, num_experts, top_k)
        self.bias = nn.Parameter(torch.empty(self.num_experts))
        self.selector = nn.Linear(self.num_experts, self.num_experts)

    def logits(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim).float()
        hidden_states = torch.tanh(F.linear(hidden_states, self.weight.float(), self.bias.float()))  # [T, E]
        return F.linear(hidden_states, self.selector.weight.float(), self.selector.bias.float())

    def forward(self, hidden_states):
        router_logits = self.logits(hidden_states)  # [T, E]
        top_k_index = torch.topk(router_logits, self.top_k, dim=-1).indices  # [T, k]
        probs = torch.sigmoid(router_logits.gather(1, top_k_index))
        return router_logits, probs - probs.detach() + 1, top_k_index


class LlamaMoEAnalyticalRouter(LlamaMoERouter):
    """CMoE's analytical router: expert e scores `|silu(x . gate_weight_e) * (x . weight_e)|`, the activation of its
    representative neuron; the top-k of `softmax(scores) + e_score_correction_bias` win (the bias, a buffer, only
    balances the choice), each weighted `1 + softmax(scores)_e * weight_scale_e`: 1 at conversion (scale 0), and the
    path by which fine-tuning reaches the router."""

    def __init__(self, config, num_experts=None, top_k=None):
        super().__init__(config, num_experts, top_k)
        self.gate_weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))
        self.weight_scale = nn.Parameter(torch.zeros(self.num_experts))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def logits(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim).float()
        gate = F.silu(F.linear(hidden_states, self.gate_weight.float()))
        return (gate * F.linear(hidden_states, self.weight.float())).abs()

    def forward(self, hidden_states):
        router_logits = self.logits(hidden_states)  # [T, E]
        probs = F.softmax(router_logits, dim=-1)
        top_k_index = torch.topk(probs + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        weights = 1 + probs.gather(1, top_k_index) * self.weight_scale.float()[top_k_index]
        return router_logits, weights, top_k_index


class LlamaMoEExpertChoiceRouter(LlamaMoETopKRouter):
    """Expert choice (Zhou et al., 2022) in training: softmax over the experts per token, then expert e takes the C
    tokens with the highest probability for it, weighted by that probability; returns (router_logits [T, E],
    weights [E, C], token ids [E, C]). A token's routing depends on the whole batch, later tokens included, so outside
    training the same logits route token-choice top-k (`LlamaMoETopKRouter`), which decodes with a KV cache."""

    def __init__(self, config, num_experts=None, top_k=None):
        super().__init__(config, num_experts, top_k)
        # C / T exactly, from the factor's decimal: 1.1 * 25 tokens * 2 / 5 experts gives C = 11, where floats give 12.
        self.capacity_ratio = Fraction(repr(config.expert_capacity_factor)) * self.top_k / self.num_experts

    @property
    def chooses_tokens(self) -> bool:
        return self.training

    def capacity(self, num_tokens: int) -> int:
        """C = ceil(expert_capacity_factor * T * k / E), at most T: the tokens each expert takes."""
        return min(num_tokens, math.ceil(self.capacity_ratio * num_tokens))

    def forward(self, hidden_states):
        if not self.chooses_tokens:
            return super().forward(hidden_states)
        router_logits = self.logits(hidden_states)  # [T, E]
        probs = F.softmax(router_logits, dim=-1).t()  # [E, T]
        weights, token_index = torch.topk(probs, self.capacity(probs.shape[1]), dim=-1)  # [E, C] each
        return router_logits, weights, token_index


# `router_type` -> router class. A new gate is one class here plus its name in configuration_llama_moe.ROUTER_TYPES.
ROUTER_CLASSES: dict[str, type[LlamaMoERouter]] = {
    "top_k": LlamaMoETopKRouter,
    "switch": LlamaMoESwitchRouter,
    "noisy_top_k": LlamaMoENoisyTopKRouter,
    "selector": LlamaMoESelectorRouter,
    "expert_choice": LlamaMoEExpertChoiceRouter,
    "analytical": LlamaMoEAnalyticalRouter,
}


# ---------------------------------------------------------------------------------------------------------------
# Experts
# ---------------------------------------------------------------------------------------------------------------


@use_experts_implementation
class LlamaMoEExperts(nn.Module):
    """Routed experts as fused 3-D tensors: `gate_up_proj [E, 2m, H]` (gate rows first), `down_proj [E, H, m]`."""

    def __init__(self, config: LlamaMoEConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    def expert(self, states: torch.Tensor, expert_idx: int) -> torch.Tensor:
        """SwiGLU of one expert on `[n, H]` rows, through views of the fused weights (no copy)."""
        gate, up = F.linear(states, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)  # [n, m] each
        return F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])  # [n, H]

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        top_k_index: torch.Tensor,  # [T, k]
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:
        """Plain reference (`experts_implementation="eager"`): each expert runs on the tokens routed to it."""
        output = torch.zeros_like(hidden_states)
        for expert_idx in range(self.num_experts):
            token_idx, slot = torch.where(top_k_index == expert_idx)  # [n] each
            if token_idx.numel():
                expert_output = self.expert(hidden_states[token_idx], expert_idx)
                output.index_add_(0, token_idx, expert_output * top_k_weights[token_idx, slot, None].to(output.dtype))
        return output

    def expert_choice(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        token_index: torch.Tensor,  # [E, C]: the tokens each expert chose
        weights: torch.Tensor,  # [E, C]
    ) -> torch.Tensor:
        """Expert-choice routing: every expert adds its weighted output to the tokens it chose. With
        `experts_implementation="eager"` the plain loop (reference); otherwise all experts at once, with fixed shapes
        and no host sync: one gather into `[E, C, H]`, one `bmm` per projection, one `index_add_` back."""
        if self.config._experts_implementation == "eager":
            return self.expert_choice_reference(hidden_states, token_index, weights)
        rows = hidden_states.index_select(0, token_index.reshape(-1)).view(*token_index.shape, -1)  # [E, C, H]
        gate, up = torch.bmm(rows, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, C, m] each
        expert_output = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))  # [E, C, H]
        expert_output = expert_output * weights.unsqueeze(-1).to(expert_output.dtype)
        output = torch.zeros_like(hidden_states)
        return output.index_add_(0, token_index.reshape(-1), expert_output.view(-1, hidden_states.shape[-1]))

    def expert_choice_reference(self, hidden_states, token_index, weights) -> torch.Tensor:
        """`expert_choice` as a plain loop over the experts."""
        output = torch.zeros_like(hidden_states)
        for expert_idx in range(self.num_experts):
            tokens = token_index[expert_idx]  # [C]
            expert_output = self.expert(hidden_states[tokens], expert_idx)
            output.index_add_(0, tokens, expert_output * weights[expert_idx, :, None].to(output.dtype))
        return output


def _decode_token(experts: LlamaMoEExperts, state: torch.Tensor, ids: list[int], weights: torch.Tensor) -> torch.Tensor:
    """`[H]`: one token's weighted sum over its experts `ids` (`weights [k]`), matrix-vector products on views of the
    fused weights. The fewest kernels: the k gate_up products are stacked once so that the activation and the
    weighting run once for all k, and the down products accumulate (`addmv`) instead of being stacked and summed."""
    gate, up = torch.stack([torch.mv(experts.gate_up_proj[e], state) for e in ids]).chunk(2, dim=-1)  # [k, m] each
    activations = experts.act_fn(gate) * up * weights[:, None]  # [k, m]
    output = torch.mv(experts.down_proj[ids[0]], activations[0])  # [H]
    for expert_idx, activation in zip(ids[1:], activations[1:]):
        output = torch.addmv(output, experts.down_proj[expert_idx], activation)
    return output


def llama_moe_cpu_experts_forward(
    self: LlamaMoEExperts,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """`experts_implementation="llama_moe_cpu"`: the fastest of three dispatches for the number of rows.

    - decoding (`T * k <= E`): the selected experts run one by one on views of the fused weights; no sort or scatter;
    - short prompts (at most `BMM_MAX_ROWS_PER_EXPERT` rows per expert, `BMM_MAX_PADDED_ROWS` in all): one batched
      matmul per projection over expert rows zero-padded to the largest count;
    - long inputs: each expert gathers only its own rows (a cache-sized working set) and adds its output back.
    Device-agnostic and autograd-friendly; tuned on CPU (docs/benchmarks.md). The scatter is `index_add_`, which
    `torch.use_deterministic_algorithms(True)` makes deterministic on CUDA as well.
    """
    weights = top_k_weights.to(hidden_states.dtype)
    if top_k_index.numel() <= self.num_experts:
        # Matrix-vector products on views of the selected experts' weights: the fewest ops per expert, which is what
        # a decoding step costs here (the weights are read once either way).
        rows = [
            _decode_token(self, hidden_states[token_idx], ids, weights[token_idx])
            for token_idx, ids in enumerate(top_k_index.tolist())
        ]  # T x [H]
        return rows[0][None] if len(rows) == 1 else torch.stack(rows)  # one token: a view, not one more copy

    # Group the S = T*k (token, expert) pairs by expert with one sort and a single host sync (the counts).
    top_k = top_k_index.shape[-1]
    sorted_experts, order = top_k_index.reshape(-1).sort()  # [S] each
    counts = torch.bincount(sorted_experts, minlength=self.num_experts)  # [E]
    counts_list = counts.tolist()
    token_index = order // top_k  # [S]
    sorted_weights = weights.reshape(-1, 1).index_select(0, order)  # [S, 1]
    output = torch.zeros_like(hidden_states)  # [T, H]

    capacity = max(counts_list)
    if capacity <= BMM_MAX_ROWS_PER_EXPERT and capacity * self.num_experts <= BMM_MAX_PADDED_ROWS:
        # Expert e's rows fill rows [e * C, (e + 1) * C) of a padded layout, C = the largest count. Padding rows
        # repeat token 0 with weight 0: computed, but they add nothing.
        first_of_expert = counts.cumsum(0) - counts  # [E]
        slot = torch.arange(order.numel(), device=order.device) - first_of_expert[sorted_experts]  # [S]
        padded_rows = sorted_experts * capacity + slot  # [S]
        row_token = token_index.new_zeros(self.num_experts * capacity).index_copy_(0, padded_rows, token_index)
        row_weight = weights.new_zeros(self.num_experts * capacity, 1).index_copy(0, padded_rows, sorted_weights)
        padded = hidden_states.index_select(0, row_token).view(self.num_experts, capacity, -1)  # [E, C, H]
        gate, up = torch.bmm(padded, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, C, m] each
        expert_output = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))  # [E, C, H]
        return output.index_add_(0, row_token, expert_output.view(row_token.numel(), -1) * row_weight)

    start = 0
    for expert_idx, count in enumerate(counts_list):
        if count:
            tokens = token_index[start : start + count]  # [n]
            expert_output = self.expert(hidden_states.index_select(0, tokens), expert_idx)  # [n, H]
            output.index_add_(0, tokens, expert_output * sorted_weights[start : start + count])
            start += count
    return output


def indexed_reduction(
    gate_up_proj: torch.Tensor,  # [E, 2m, H]
    down_proj: torch.Tensor,  # [E, H, m]
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
    act_fn,
) -> torch.Tensor:
    """`[T, H]`: each projection as a product and a sum over the selected experts' weights, indexed where they lie.
    Inductor turns the indexing into loads inside one reduction kernel on every thread, so the selected weights are
    read once and never copied (`grouped_mm` first gathers them into a new tensor, and decoding is bound by weight
    reads). In eager mode the indexing would copy: run it compiled only."""
    gate_up = (gate_up_proj[top_k_index] * hidden_states[:, None, None, :]).sum(-1)  # [T, k, 2m]
    gate, up = gate_up.chunk(2, dim=-1)  # [T, k, m] each
    expert_output = (down_proj[top_k_index] * (act_fn(gate) * up)[:, :, None, :]).sum(-1)  # [T, k, H]
    return (expert_output * top_k_weights.to(expert_output.dtype)[..., None]).sum(1)  # [T, H]


def indexed_reduction_experts_forward(self: LlamaMoEExperts, hidden_states, top_k_index, top_k_weights):
    """Few (token, expert) pairs under `torch.compile` (`indexed_reduction`)."""
    return indexed_reduction(self.gate_up_proj, self.down_proj, hidden_states, top_k_index, top_k_weights, self.act_fn)


def silu_indexed_reduction(gate_up_proj, down_proj, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """`indexed_reduction` with SiLU: a function of its own, because Dynamo keeps its compiled graphs (and their limit
    of 8) per code object, which every compiled `functools.partial` shares."""
    return indexed_reduction(gate_up_proj, down_proj, hidden_states, top_k_index, top_k_weights, F.silu)


def silu_mlp_reduction(gate_proj, up_proj, down_proj, hidden_states) -> torch.Tensor:
    """`[T, H]`: a SwiGLU MLP (`gate_proj`, `up_proj` `[m, H]`, `down_proj` `[H, m]`) as products and sums, which
    inductor runs on every thread: `llama_moe_cpu_compiled`'s kernel for the shared experts."""
    states = hidden_states[:, None, :]  # [T, 1, H]
    hidden = F.silu((gate_proj * states).sum(-1)) * (up_proj * states).sum(-1)  # [T, m]
    return (down_proj * hidden[:, None, :]).sum(-1)  # [T, H]


@functools.cache
def compiled(kernel):
    """`kernel` compiled by inductor on first use: `llama_moe_cpu_compiled`'s eager-mode decoding kernels
    (`silu_indexed_reduction` for the routed experts, `silu_mlp_reduction` for the shared ones)."""
    return torch.compile(kernel, fullgraph=True)


_SILU_TYPES = (nn.SiLU, type(ACT2FN["silu"]))  # "silu" and "swish"
_COMPILE_FAILED: list[str] = []  # why compiling a decoding kernel failed in this process, once it has


def compiled_decoding_applies(config, hidden_states: torch.Tensor, act_fn) -> bool:
    """Whether `llama_moe_cpu_compiled` runs a compiled kernel for `hidden_states` (`[T, H]`): chosen in `config`,
    decoding-sized (`T * k <= E` (token, expert) pairs), eager mode on CPU without autograd, SiLU, and no compile has
    failed in this process."""
    return (
        getattr(config, "_experts_implementation", None) == "llama_moe_cpu_compiled"
        and hidden_states.shape[0] * config.num_experts_per_tok <= config.num_experts
        and hidden_states.is_cpu
        and not torch.is_grad_enabled()
        and not is_torchdynamo_compiling()
        and isinstance(act_fn, _SILU_TYPES)
        and not _COMPILE_FAILED
    )


def run_compiled(kernel, *inputs: torch.Tensor) -> torch.Tensor | None:
    """`compiled(kernel)(*inputs)` (the weights among `inputs` detached: plain inputs, so no guard on requires_grad
    and shapes that may become dynamic), or None where it did not run: past Dynamo's recompile limit (for this call),
    or when compiling failed (said once; no compiled kernel runs in this process from then on)."""
    try:
        return compiled(kernel)(*inputs)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        return None
    except Exception as error:  # noqa: BLE001 - inductor fails in many ways; the eager path is exact
        _COMPILE_FAILED.append(f"{type(error).__name__}: {str(error).strip()[:200]}")
        message = "llama_moe_cpu_compiled could not compile its decoding kernel, so it runs llama_moe_cpu: "
        warnings.warn(message + _COMPILE_FAILED[0], stacklevel=3)
        return None


def llama_moe_cpu_compiled_experts_forward(self: LlamaMoEExperts, hidden_states, top_k_index, top_k_weights):
    """`experts_implementation="llama_moe_cpu_compiled"`: `llama_moe_auto`, except that decoding-sized inputs (`T * k
    <= E`) in eager mode on CPU without autograd (SiLU experts, no expert parallelism) run `indexed_reduction`
    compiled by inductor, and so do the shared experts (`silu_mlp_reduction`): every thread reads the weights, where
    `torch.mv` uses one (2/8 split decoding +18%, docs/benchmarks.md). Compiling takes seconds, once per process and
    per dtype and input shape class, so it is not the default. Where inductor cannot compile (no C++ compiler) it
    says so once and runs `llama_moe_cpu` from then on; a variant beyond Dynamo's recompile limit runs
    `llama_moe_cpu` alone."""
    output = None
    if not self._is_expert_parallel and compiled_decoding_applies(self.config, hidden_states, self.act_fn):
        weights = (self.gate_up_proj.detach(), self.down_proj.detach())
        output = run_compiled(silu_indexed_reduction, *weights, hidden_states, top_k_index, top_k_weights)
    if output is None:
        output = llama_moe_auto_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return output


def llama_moe_auto_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """`experts_implementation="llama_moe_auto"` (the default): `llama_moe_cpu` on CPU; compiled on CPU, the indexed
    reduction for decoding-sized inputs (`T * k <= E`; 1.78x dense tokens/s against 1.39x for `grouped_mm` in
    docs/benchmarks.md); otherwise, under `torch.compile` (which needs shapes that do not depend on the routing) and
    with expert parallelism (whose dispatch marks the tokens of other ranks' experts), transformers' `grouped_mm`,
    the default of its own MoE families; eager on a GPU, decoding-sized inputs take `batched_mm`, as transformers'
    `generate` switches its own MoE models to for decoding there (2/8 split 0.66x dense tokens/s against 0.55x with
    `grouped_mm` on an H200, where batch-1 decoding of so small a model is bound by kernel launches)."""
    if self._is_expert_parallel:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    on_cpu = hidden_states.device.type == "cpu"
    compiling, decoding = is_torchdynamo_compiling(), top_k_index.numel() <= self.num_experts
    if on_cpu and not compiling:
        return llama_moe_cpu_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if on_cpu and decoding:
        return indexed_reduction_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if decoding and not compiling:
        return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


ALL_EXPERTS_FUNCTIONS.register("llama_moe_cpu", llama_moe_cpu_experts_forward)
ALL_EXPERTS_FUNCTIONS.register("llama_moe_cpu_compiled", llama_moe_cpu_compiled_experts_forward)
ALL_EXPERTS_FUNCTIONS.register("llama_moe_auto", llama_moe_auto_experts_forward)


def expert_one_hot(index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[..., k, E]` bool: whether each entry of `index` (`[..., k]` expert ids) is expert e. A comparison rather than
    a scatter: one pointwise op, which inductor fuses into the ops that read it."""
    return index[..., None] == torch.arange(num_experts, device=index.device)


class LlamaMoESharedExperts(nn.Module):
    """Always-on shared experts, fused into one SwiGLU MLP of `num_shared_experts * shared_expert_intermediate_size`."""

    def __init__(self, config: LlamaMoEConfig):
        super().__init__()
        intermediate_size = config.num_shared_experts * config.shared_expert_intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.config = config  # whose experts implementation may compile these too (`llama_moe_cpu_compiled`)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [T, H]
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if compiled_decoding_applies(self.config, hidden_states, self.act_fn) and all(
            type(p) is nn.Linear for p in projections
        ):  # plain layers only: an adapter's (LoRA) weights are not in `.weight`
            output = run_compiled(silu_mlp_reduction, *(p.weight.detach() for p in projections), hidden_states)
            if output is not None:
                return output
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


# ---------------------------------------------------------------------------------------------------------------
# Block, layer, model
# ---------------------------------------------------------------------------------------------------------------


class LlamaMoESparseMoeBlock(nn.Module):
    """output = score_scale_factor * sum_{e in top-k} w_e * expert_e(x)  [+ shared_experts(x)]
    [+ sum_{e not in top-k} compensation_e  (G-MoEfication, `config.moe_compensation`)]

    Under expert-choice routing in training, the experts of a token are those that chose it (0 to E of them)."""

    def __init__(self, config: LlamaMoEConfig, layer_idx: int):
        super().__init__()
        self.score_scale_factor = config.layer_score_scale(layer_idx)
        self.z_loss_weight = config.router_z_loss_coef / config.num_router_layers
        self.mi_loss_weight = config.router_mi_loss_coef / config.num_router_layers
        self.gate = ROUTER_CLASSES[config.router_type](config)
        self.experts = LlamaMoEExperts(config)
        self.shared_experts = LlamaMoESharedExperts(config) if config.num_shared_experts > 0 else None
        # G-MoEfication representative values: row e stands in for expert e's output when it is not selected.
        self.compensation = (
            nn.Parameter(torch.zeros(config.num_experts, config.hidden_size)) if config.moe_compensation else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        flat_states = hidden_states.view(-1, hidden_dim)  # [T, H]
        # weights, index: [T, k], each token's experts; [E, C], each expert's tokens, when the router chooses tokens
        router_logits, weights, index = self.gate(flat_states)
        chooses_tokens = self.gate.chooses_tokens
        if self.score_scale_factor != 1.0:
            weights = weights * self.score_scale_factor
        if chooses_tokens:
            output = self.experts.expert_choice(flat_states, index, weights)
        else:
            output = self.experts(flat_states, index, weights)
        if self.compensation is not None:
            output = output + self.compensation_output(index, flat_states.shape[0], chooses_tokens).to(output.dtype)
        if self.shared_experts is not None:
            output = output + self.shared_experts(flat_states)
        if self.z_loss_weight or self.mi_loss_weight:
            loss = router_losses(router_logits, self.z_loss_weight, self.mi_loss_weight)
            output = attach_router_loss(self, output, loss)
        return output.view(batch_size, sequence_length, hidden_dim)

    def compensation_output(self, index: torch.Tensor, num_tokens: int, chooses_tokens: bool) -> torch.Tensor:
        """`[T, H]`: the sum of the compensation rows of each token's unselected experts (0 when all are selected)."""
        if chooses_tokens:  # index [E, C]: expert e took the tokens index[e]
            unselected = self.compensation.new_ones(num_tokens, self.compensation.shape[0])  # [T, E] 0/1 mask
            unselected.scatter_(0, index.t(), 0.0)
        else:  # index [T, k]
            unselected = (~expert_one_hot(index, self.compensation.shape[0]).any(1)).to(self.compensation.dtype)
        return unselected @ self.compensation


class LlamaMoEDecoderLayer(GradientCheckpointingLayer):
    moe_block_class = LlamaMoESparseMoeBlock  # the MLP of `config.moe_layers` (a family may swap in its own)

    def __init__(self, config: LlamaMoEConfig, layer_idx: int):
        super().__init__()
        attention_class, norm_class, _ = source_modules(config.source_model_type)
        self.hidden_size = config.hidden_size
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = attention_class(config=config, layer_idx=layer_idx)
        self.mlp = self.moe_block_class(config, layer_idx) if layer_idx in config.moe_layers else LlamaMLP(config)
        self.input_layernorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)

    @accepts_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        hidden_states = self.attention_residual(
            hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, **kwargs
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    def attention_residual(
        self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, **kwargs
    ) -> torch.Tensor:
        """`h + self_attn(input_layernorm(h))`: the layer's first half (a family with its own MLP call reuses it)."""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # hidden_states positionally: a module called with keyword arguments only fires its full backward hooks
        # before its own backward (DeepSpeed reduces a ZeRO-3 leaf's gradients in one: AttnMoE's attention).
        hidden_states, _ = self.self_attn(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **{CACHE_ARG: cache},
            **kwargs,
        )
        return residual + hidden_states


def _own_class(model) -> type:
    """The model's class in this package, under any subclass a wrapper made for it in torch (FSDP2)."""
    return next(cls for cls in type(model).__mro__ if not cls.__module__.startswith("torch."))


SAVE_HOOKS = "llama_moe_hf.model_saved"  # entry-point group: called as hook(model, save_directory, is_main_process)


def _run_save_hooks(model, save_directory, is_main_process: bool) -> None:
    """Call what the installed llama-moe-hf registers for saved models (the training card of a `trl sft` run: TRL
    runs this file as remote code and never imports the package). A failing hook costs the card, not the save."""
    from importlib.metadata import entry_points

    for hook in entry_points(group=SAVE_HOOKS):
        try:
            hook.load()(model, save_directory, is_main_process=is_main_process)
        except Exception as error:  # noqa: BLE001 - the weights are saved; say why the extra files are not
            warnings.warn(f"{hook.value} did not run after the save to {save_directory}: {error}", stacklevel=3)


def _file_stamps(folder) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every regular file directly in `folder`, which may not exist yet."""
    if not os.path.isdir(folder):
        return {}
    return {
        entry.name: (entry.inode(), entry.stat().st_mtime_ns)
        for entry in os.scandir(folder)
        if entry.is_file(follow_symlinks=False)
    }


def _chmod_written_files(folder, before: dict[str, tuple[int, int]]) -> None:
    """Give the files written in `folder` since `before` the mode a plain `open` gives, `0o666 & ~umask`:
    safetensors writes the weights through a 0600 temporary file, and `trl sft` saves without us touching them."""
    umask = os.umask(0)  # reading the umask means setting it: put it back at once
    os.umask(umask)
    for name, stamp in _file_stamps(folder).items():
        if before.get(name) != stamp:
            os.chmod(os.path.join(folder, name), 0o666 & ~umask)


class LlamaMoEPreTrainedModel(PreTrainedModel):
    config: LlamaMoEConfig
    config_class = LlamaMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaMoEDecoderLayer"]
    _skip_keys_device_placement = [CACHE_ARG]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True  # compiled, the default experts run without host syncs (llama_moe_auto)
    _supports_attention_backend = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(LlamaMoERouter, index=0),
        "hidden_states": LlamaMoEDecoderLayer,
        "attentions": "self_attn",  # by module name: the attention class is the source family's
    }

    # Auto class -> head class of this family (in this file): registered with transformers' Auto classes, and
    # written into `auto_map` on save so that every head loads from a saved folder as remote code.
    auto_heads = {
        "AutoModel": "LlamaMoEModel",
        "AutoModelForCausalLM": "LlamaMoEForCausalLM",
        "AutoModelForSequenceClassification": "LlamaMoEForSequenceClassification",
        "AutoModelForTokenClassification": "LlamaMoEForTokenClassification",
        "AutoModelForQuestionAnswering": "LlamaMoEForQuestionAnswering",
    }

    def add_auto_map(self) -> None:
        """Name every head of the family in `config.auto_map` (transformers would name only the saved class)."""
        module = type(self).__module__.rsplit(".", 1)[-1]
        heads = {auto: f"{module}.{name}" for auto, name in self.auto_heads.items()}
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **heads}

    def save_pretrained(self, save_directory, *args, **kwargs):
        # FSDP2's `fully_shard` swaps in a subclass made in torch (`FSDPLlamaMoEForCausalLM`); transformers would copy
        # torch's files as the model code and name that class in `auto_map`. Saved as our own class, for the save.
        wrapper, self.__class__ = self.__class__, _own_class(self)
        try:
            self.add_auto_map()
            before = _file_stamps(save_directory)
            result = super().save_pretrained(save_directory, *args, **kwargs)
            _chmod_written_files(save_directory, before)
        finally:
            self.__class__ = wrapper
        _run_save_hooks(self, save_directory, kwargs.get("is_main_process", True))
        return result

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers decides by searching the class's module source for `@use_experts_implementation`; AttnMoE's
        # file has no experts class of its own (its MLP experts are these), so every family here says yes.
        return True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # transformers would default to grouped_mm everywhere; `llama_moe_auto` keeps it off CPU only.
        return super().get_correct_experts_implementation(requested_experts or "llama_moe_auto")

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, LlamaMoEExperts):
            nn.init.normal_(module.gate_up_proj, mean=0.0, std=std)
            nn.init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, LlamaMoERouter):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, LlamaMoENoisyTopKRouter):
                nn.init.zeros_(module.noise_weight)
            if isinstance(module, LlamaMoESelectorRouter):
                nn.init.zeros_(module.bias)
            if isinstance(module, LlamaMoEAnalyticalRouter):
                nn.init.normal_(module.gate_weight, mean=0.0, std=std)
                nn.init.zeros_(module.weight_scale)
                nn.init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, LlamaMoESparseMoeBlock) and module.compensation is not None:
            nn.init.zeros_(module.compensation)


class LlamaMoEModel(LlamaMoEPreTrainedModel):
    decoder_layer_class = LlamaMoEDecoderLayer  # AttnMoE and SoapMoE swap in their own layers and reuse the rest
    output_class = MoeModelOutputWithPast

    def __init__(self, config: LlamaMoEConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [self.decoder_layer_class(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        _, norm_class, rotary_class = source_modules(config.source_model_type)
        self.norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_class(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    @accepts_past_key_values
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        masks = self.attention_masks(inputs_embeds, attention_mask, position_ids, cache)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=masks[decoder_layer.attention_type],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=use_cache,
                **{CACHE_ARG: cache},
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return self.output_class(last_hidden_state=hidden_states, **{CACHE_ARG: cache})

    def attention_masks(self, inputs_embeds, attention_mask, position_ids, cache) -> dict:
        """The mask of each layer type of `config.layer_types` (sliding windows as the source family has them);
        `generate` may have made them already."""
        if isinstance(attention_mask, dict):
            return attention_mask
        mask_kwargs = {
            "config": self.config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            CACHE_ARG: cache,
        }
        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: make[kind](**mask_kwargs) for kind in set(self.config.layer_types)}


# ---------------------------------------------------------------------------------------------------------------
# Heads
# ---------------------------------------------------------------------------------------------------------------


class LlamaMoEForCausalLM(LlamaMoEPreTrainedModel, GenerationMixin):
    backbone_class = LlamaMoEModel
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: LlamaMoEConfig):
        super().__init__(config)
        self.model = self.backbone_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    @accepts_past_key_values
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        r"""
        `aux_loss` is the (unweighted) Switch load-balancing loss of `router_logits`, as in Mixtral; with `labels`,
        `loss = lm_loss + router_aux_loss_coef * aux_loss + the other router losses` (z-loss, MI loss, attention
        balance loss; in training, weighted by `router_loss_share`). Without `labels`, and under `torch.compile`, those
        are attached to the graph in training instead (see the module docstring): their gradients flow, unweighted,
        and `loss` leaves them out.
        """
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        collect = labels is not None and not is_torchdynamo_compiling()  # compiled, the losses stay attached
        backbone = functools.partial(
            self.model,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        # Compiled, no with-block around the backbone: Dynamo failed to resume after a graph break inside one (SoapMoE)
        outputs, router_loss_terms = collect_router_losses(backbone) if collect else (backbone(), [])
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            if router_loss_terms:
                share = router_loss_share(labels, **kwargs)
                loss = loss + share * sum(term.to(loss.device) for term in router_loss_terms)
        aux_loss = self.router_aux_loss(outputs, attention_mask) if output_router_logits else None
        if aux_loss is not None and labels is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return self.causal_lm_output(outputs, attention_mask, loss=loss, aux_loss=aux_loss, logits=logits)

    def router_aux_loss(self, outputs: MoeModelOutputWithPast, attention_mask) -> torch.Tensor | None:
        """The Switch load-balancing loss of `router_logits` (unweighted), as in Mixtral."""
        if not outputs.router_logits:
            return None
        return load_balancing_loss_func(
            outputs.router_logits, self.config.num_experts, self.config.num_experts_per_tok, attention_mask
        )

    def causal_lm_output(self, outputs: MoeModelOutputWithPast, attention_mask, **fields) -> MoeCausalLMOutputWithPast:
        return MoeCausalLMOutputWithPast(
            **{CACHE_ARG: output_cache(outputs)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            **fields,
        )


class LlamaMoEForSequenceClassification(GenericForSequenceClassification, LlamaMoEPreTrainedModel):
    backbone_class = LlamaMoEModel

    def __init__(self, config: LlamaMoEConfig):
        # The generic head builds its backbone with AutoModel.from_config, which a checkpoint loaded as remote code
        # cannot resolve; build the same modules (same keys) directly.
        LlamaMoEPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = self.backbone_class(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class LlamaMoEForTokenClassification(GenericForTokenClassification, LlamaMoEPreTrainedModel):
    backbone_class = LlamaMoEModel

    def __init__(self, config: LlamaMoEConfig):
        LlamaMoEPreTrainedModel.__init__(self, config)  # see LlamaMoEForSequenceClassification
        self.num_labels = config.num_labels
        self.model = self.backbone_class(config)
        dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=True)
        self.post_init()


class LlamaMoEForQuestionAnswering(GenericForQuestionAnswering, LlamaMoEPreTrainedModel):
    """Extractive question answering (start and end logits per token), like `MixtralForQuestionAnswering`."""

    backbone_class = LlamaMoEModel

    def __init__(self, config: LlamaMoEConfig):
        LlamaMoEPreTrainedModel.__init__(self, config)  # see LlamaMoEForSequenceClassification
        self.model = self.backbone_class(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


__all__ = [
    "CACHE_ARG",
    "ROUTER_CLASSES",
    "LlamaMoEExperts",
    "LlamaMoEForCausalLM",
    "LlamaMoEForQuestionAnswering",
    "LlamaMoEForSequenceClassification",
    "LlamaMoEForTokenClassification",
    "LlamaMoEModel",
    "LlamaMoEPreTrainedModel",
    "LlamaMoERouter",
    "LlamaMoESparseMoeBlock",
]

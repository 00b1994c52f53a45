"""The routers (gates) of the MoE blocks, one class per `config.router_type` (`ROUTER_CLASSES`): hidden states [T, H]
-> (router_logits [T, E], top-k weights [T, k], top-k expert ids [T, k]), in float32; the expert-choice router in
training gives each expert's tokens instead (weights [E, C], token ids [E, C]). LlamaMoE's MLP experts and AttnMoE's
attention-head experts are routed by these. A new gate is one subclass of `LlamaMoERouter` with its own `router_type`
(its `init_weights` included): defining it registers it in `ROUTER_CLASSES`, which the configs validate against and the
command line reads (without importing this file: `conversion.settings` reads the class attributes).

This file is copied next to saved checkpoints (remote code): it imports only torch and transformers.
"""

import math
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils.import_utils import is_torchdynamo_compiling

# `router_type` -> router class, filled as the classes are defined (`LlamaMoERouter.__init_subclass__`).
ROUTER_CLASSES: dict[str, type["LlamaMoERouter"]] = {}


class LlamaMoERouter(nn.Module):
    """Base of the token-choice routers: `weight [E, H]`, logits in float32. Subclasses pick the experts.

    `num_experts` / `top_k` override the config's when something other than the MLP experts is routed (AttnMoE's
    attention-head experts).
    """

    # Whether `forward` returns each expert's chosen tokens (`[E, C]`) rather than each token's experts (`[T, k]`).
    chooses_tokens = False
    token_choice = True  # whether it routes by tokens' choices in training too (attention experts need it)
    # What the gate means, read by the conversion plan and the export targets (never its name). The defaults are
    # those of a gate that says nothing: every target refuses it until it states how it maps.
    router_type = ""  # its `config.router_type`
    renormalizes = True  # the chosen experts' weights sum to 1 (Mixtral's routing; Qwen2-MoE's `norm_topk_prob`)
    # why no stock family's softmax top-k of linear logits computes it (None: one does)
    stock_refusal: str | None = (
        "the targets route by a softmax top-k of linear logits, and no exact mapping of this router is known"
    )
    inference_note: str | None = None  # exported as its inference routing: what training does that inference does not
    # why its experts do not average into one FFN (`export --to dense`; None: they do)
    dense_refusal: str | None = (
        "router_type {router_type!r}: the dense target takes routers whose top-k weights sum to 1, and no mapping of "
        "this router to one FFN is known"
    )
    untrained_tensors: tuple[str, ...] = ()  # parameters a router init leaves out, zero until trained (never exported)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "router_type" in cls.__dict__:  # a gate of its own, not a helper subclass that inherits one
            ROUTER_CLASSES[cls.router_type] = cls

    def __init__(self, config, num_experts: int | None = None, top_k: int | None = None):
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
            # matmul is an external call of its own.
            return (states.unsqueeze(-2) * self.weight.float()).sum(-1)
        return F.linear(states, self.weight.float())

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def init_weights(self, std: float) -> None:
        """Random initialisation (`PreTrainedModel._init_weights`); conversion sets trained or fitted weights."""
        nn.init.normal_(self.weight, mean=0.0, std=std)


class LlamaMoETopKRouter(LlamaMoERouter):
    """Softmax over all experts, keep the top-k, renormalise them to sum to 1 (Mixtral, LLaMA-MoE)."""

    router_type = "top_k"
    stock_refusal = dense_refusal = None

    def forward(self, hidden_states):
        router_logits = self.logits(hidden_states)  # [T, E]
        top_k_logits, top_k_index = torch.topk(router_logits, self.top_k, dim=-1)  # [T, k]
        # The renormalised top-k of a softmax is the softmax of the top-k logits: one small softmax instead of two.
        return router_logits, F.softmax(top_k_logits, dim=-1), top_k_index


class LlamaMoESwitchRouter(LlamaMoERouter):
    """Softmax over all experts, keep the top-k probabilities as they are (the Switch Transformer gate for k = 1)."""

    router_type = "switch"
    renormalizes = False
    stock_refusal = None
    dense_refusal = (
        "router_type 'switch' does not renormalise the top-k probabilities: a token's experts weigh less than 1 in "
        "all, by an amount that varies by token, which no fixed FFN computes (not even for identical experts)"
    )

    def forward(self, hidden_states):
        router_logits = self.logits(hidden_states)  # [T, E]
        top_k_weights, top_k_index = torch.topk(F.softmax(router_logits, dim=-1), self.top_k, dim=-1)  # [T, k]
        return router_logits, top_k_weights, top_k_index


class LlamaMoENoisyTopKRouter(LlamaMoETopKRouter):
    """`top_k` on `x W + N(0, 1) * softplus(x W_noise)`; the noise only in training (Shazeer et al., 2017)."""

    router_type = "noisy_top_k"
    inference_note = (
        "router_type 'noisy_top_k' is exported as its inference routing, softmax top-k: its learned noise is added in "
        "training only (mlp.gate.noise_weight is not exported)"
    )
    untrained_tensors = ("noise_weight",)

    def __init__(self, config, num_experts=None, top_k=None):
        super().__init__(config, num_experts, top_k)
        self.noise_weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))

    def init_weights(self, std):
        super().init_weights(std)
        nn.init.zeros_(self.noise_weight)

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

    router_type = "selector"
    renormalizes = False
    stock_refusal = (
        "MoEfication's selector scores experts with a tanh MLP and weights every chosen expert 1, where the targets' "
        "routers weight them by a softmax of linear logits"
    )
    dense_refusal = "router_type 'selector' weights every chosen expert 1 (top-k in all), not a mean of its experts"

    def __init__(self, config, num_experts=None, top_k=None):
        super().__init__(config, num_experts, top_k)
        self.bias = nn.Parameter(torch.empty(self.num_experts))
        self.selector = nn.Linear(self.num_experts, self.num_experts)

    def init_weights(self, std):
        super().init_weights(std)
        nn.init.zeros_(self.bias)

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

    router_type = "analytical"
    renormalizes = False
    stock_refusal = (
        "CMoE's router scores experts by a SwiGLU activation, |silu(x . g) * (x . u)|, and weights every chosen "
        "expert 1 (at conversion), where the targets' routers weight them by a softmax of linear logits"
    )
    dense_refusal = (
        "router_type 'analytical' weights every chosen expert 1 plus a learned share (top-k or more in all), not a "
        "mean of its experts"
    )

    def __init__(self, config, num_experts=None, top_k=None):
        super().__init__(config, num_experts, top_k)
        self.gate_weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))
        self.weight_scale = nn.Parameter(torch.zeros(self.num_experts))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def init_weights(self, std):
        super().init_weights(std)
        nn.init.normal_(self.gate_weight, mean=0.0, std=std)
        nn.init.zeros_(self.weight_scale)
        nn.init.zeros_(self.e_score_correction_bias)

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

    router_type = "expert_choice"
    token_choice = False
    inference_note = (
        "router_type 'expert_choice' is exported as its inference routing, token-choice softmax top-k (what "
        "model.eval() and generate compute); expert-choice routing and its capacity exist in training only"
    )

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

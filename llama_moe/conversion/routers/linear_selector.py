"""The expert selector's ranking in a router every export target computes: linear logits, softmax top-k.

MoEfication's selector (`selector.py`) scores experts with a tanh MLP and gives each chosen expert weight 1, which
Mixtral, Qwen2-MoE, Qwen3-MoE and llama.cpp cannot express. This init fits the same objective (the listwise ranking of
each expert's deviation energy, `gmoefication.selector_loss`) with linear logits `W x`, for `router_type: top_k`
(softmax over the chosen logits, as Mixtral and Qwen2-MoE with `norm_topk_prob` route). The renormalised weights of
k chosen experts sum to 1, so the default score scale is k (`even_weights`), and the logits are multiplied by the
temperature `t` that best reproduces unit weights on the calibration tokens:

    routed(x) = k * sum_{e in top-k(Wx)} softmax_{top-k}(t Wx)_e * expert_e(x)     target: sum_{e in all} expert_e(x)

`t` scales the weights only: the top-k of `t W x` is that of `W x` for every t > 0. At top-1 the weight is 1 whatever
`t`, exactly the selector's weighting.
"""

from dataclasses import dataclass

from ..registry import ROUTER_INITS, option
from .selector import SELECTOR_OBJECTIVES, SelectorRouter

TEMPERATURES = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
TEMPERATURE_TOKENS = 2048  # calibration tokens the temperature is chosen on


@dataclass(frozen=True)
class LinearSelectorOptions:
    linear_selector_steps: int = option(100, "L-BFGS iterations per layer of the linear router's fit")
    linear_selector_objective: str = option(
        "listwise", "the fit's loss (the selector's objectives)", choices=SELECTOR_OBJECTIVES
    )


@ROUTER_INITS.register("linear_selector")
class LinearSelectorRouter(SelectorRouter):
    description = (
        "the expert selector's objective (rank the experts by the output a token would lose without them) fitted as "
        "linear softmax top-k logits, which every export target computes; score scale k, the logits' temperature "
        "chosen on calibration tokens"
    )
    Options = LinearSelectorOptions
    router_type = None  # a linear router: `top_k` (plan.py refuses the other gates for `even_weights`)
    unit_weights = False
    even_weights = True
    fitted_router_type = "top_k"

    def tensors(self, layer_idx, built, context) -> dict:
        state, quality = self.fit(layer_idx, built, context)
        states = context.mlp(layer_idx).hidden_states[:TEMPERATURE_TOKENS]
        temperature = even_weight_temperature(states, built.tensors, state["weight"], self.target.top_k)
        self._quality.append(quality | {"temperature": temperature})
        return {"weight": state["weight"] * temperature}

    def fit_settings(self) -> tuple[int, str]:
        return self.options.linear_selector_steps, self.options.linear_selector_objective


def even_weight_temperature(hidden_states, expert_tensors: dict, weight, top_k: int) -> float:
    """The `TEMPERATURES` entry whose renormalised top-k weights, times k, best reproduce the sum of every routed
    expert's output on `hidden_states [n, H]` (squared error); 1.0 at top-1, where the weight is 1 whatever it is."""
    import torch
    import torch.nn.functional as F

    if top_k == 1:
        return 1.0
    gate_up, down = expert_tensors["experts.gate_up_proj"].float(), expert_tensors["experts.down_proj"].float()
    states = hidden_states.float()
    gate, up = torch.einsum("th,efh->tef", states, gate_up).chunk(2, dim=-1)  # [n, E, m] each
    outputs = torch.einsum("tem,ehm->teh", F.silu(gate) * up, down)  # [n, E, H]
    logits, index = torch.topk(states @ weight.float().T, top_k, dim=-1)  # [n, k]
    chosen = outputs.gather(1, index[..., None].expand(-1, -1, outputs.shape[-1]))  # [n, k, H]
    target = outputs.sum(1)  # [n, H]

    def error(temperature: float) -> float:
        weights = top_k * F.softmax(logits * temperature, dim=-1)  # [n, k]
        return (target - (weights[..., None] * chosen).sum(1)).pow(2).sum().item()

    return min(TEMPERATURES, key=error)

"""Training-free attention routers fitted on calibration text."""

from dataclasses import dataclass

from ...registry import ROUTER_INITS, option
from ...target import ATTENTION
from ..base import RouterInit


@dataclass(frozen=True)
class FitOptions:
    attn_fit_ridge: float = option(1e-2, "ridge of the attention-router fit, relative to the mean input energy")
    attn_fit_logit_std: float = option(0.1, "spread of the fitted attention-router logits on the calibration data")


@ROUTER_INITS.register("fit")
class FitRouter(RouterInit):
    description = (
        "fitted on calibration text: a ridge regression from the attention input to each expert's output norm, so "
        "the router prefers the experts that contribute most"
    )
    Options = FitOptions
    targets = (ATTENTION,)

    def request(self, context) -> None:
        context.request_attention(self.target.layers, self.target.num_experts)

    def tensors(self, layer_idx, built, context) -> dict:
        from .attention_fit import fit_attention_router

        o = self.options
        stats = context.attention(layer_idx, self.target.num_experts)
        return {"weight": fit_attention_router(stats, o.attn_fit_ridge, o.attn_fit_logit_std)}

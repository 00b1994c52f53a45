"""All-zero router weights."""

from ..registry import ROUTER_INITS
from .base import RouterInit


@ROUTER_INITS.register("zero")
class ZeroRouter(RouterInit):
    description = (
        "zeros: every expert gets the same score until trained (with top-k = experts and scale = experts, exactly the "
        "dense model; with fewer, the top-k ties go to the first experts)"
    )

    def tensors(self, layer_idx, built, context) -> dict:
        import torch

        return {"weight": torch.zeros(self.target.num_experts, self.dense_config.hidden_size)}

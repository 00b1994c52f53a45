"""`uniform_random`: torch.nn.Linear's own initialisation of the router (mergekit-moe's `uniform_random`)."""

from ..registry import ROUTER_INITS
from ..target import ATTENTION, ATTENTION_ROUTER_STREAM, ROUTER_STREAM, layer_seed
from .base import RouterInit


@ROUTER_INITS.register("uniform_random")
class UniformRandomRouter(RouterInit):
    description = "uniform in +-1/sqrt(hidden_size) (torch.nn.Linear's default init), seeded per layer"

    def tensors(self, layer_idx, built, context) -> dict:
        import math

        import torch

        stream = ATTENTION_ROUTER_STREAM if self.target.kind == ATTENTION else ROUTER_STREAM
        generator = torch.Generator().manual_seed(layer_seed(self.recipe.seed, layer_idx, stream))
        weight = torch.empty(self.target.num_experts, self.dense_config.hidden_size)
        return {"weight": torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)}

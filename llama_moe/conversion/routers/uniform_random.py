"""`uniform_random`: torch.nn.Linear's own initialisation of the router (mergekit-moe's `uniform_random`)."""

from ..registry import ROUTER_INITS
from .base import RouterInit


@ROUTER_INITS.register("uniform_random")
class UniformRandomRouter(RouterInit):
    description = "uniform in +-1/sqrt(hidden_size) (torch.nn.Linear's default init), seeded per layer"

    def tensors(self, layer_idx, built, context) -> dict:
        import math

        import torch

        generator = self.generator(layer_idx)
        weight = torch.empty(self.target.num_experts, self.dense_config.hidden_size)
        return {"weight": torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)}

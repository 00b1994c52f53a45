"""Random normal router weights."""

from ..registry import ROUTER_INITS
from .base import RouterInit


@ROUTER_INITS.register("random")
class RandomRouter(RouterInit):
    description = "random normal (std = the config's initializer_range), seeded per layer: the usual start for training"

    def tensors(self, layer_idx, built, context) -> dict:
        import torch

        generator = self.generator(layer_idx)
        shape = (self.target.num_experts, self.dense_config.hidden_size)
        return {"weight": torch.randn(shape, generator=generator) * self.dense_config.initializer_range}

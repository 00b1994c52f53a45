"""LLaMA-MoE's Independent-Random split."""

from ..registry import METHODS
from ..target import SPLIT_STREAM, layer_seed
from .base import SplitMethod


@METHODS.register("random")
class RandomSplit(SplitMethod):
    description = (
        "LLaMA-MoE Independent-Random: each layer's FFN neurons are shuffled (seeded) and cut into equal experts."
    )
    mergeable = True

    def split(self, layer_idx, dense, context):
        from ..experts import split_random

        t = self.target
        seed = layer_seed(self.recipe.seed, layer_idx, SPLIT_STREAM)
        return split_random(self.dense_config.intermediate_size, t.num_experts, t.num_shared_experts, seed=seed)

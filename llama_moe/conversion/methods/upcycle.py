"""Sparse upcycling (Komatsuzaki et al., 2023)."""

import dataclasses

from ..registry import METHODS, option
from ..target import SPLIT_STREAM, layer_seed
from .base import SplitMethod


@dataclasses.dataclass(frozen=True)
class UpcycleOptions:
    upcycle_noise: float = option(
        0.0,
        "Gaussian noise added to each expert copy, as a fraction of the weight's std (breaks the experts' symmetry; "
        "0: exact copies)",
    )


@METHODS.register("upcycle")
class Upcycle(SplitMethod):
    description = "Sparse upcycling: every expert is a full copy of the dense FFN."
    Options = UpcycleOptions
    allows_shared_experts = False
    neuron_split = False  # every expert holds every neuron
    mergeable = True

    def split(self, layer_idx, dense, context):
        from ..experts import split_upcycle

        return split_upcycle(self.dense_config.intermediate_size, self.target.num_experts)

    def build(self, layer_idx, dense, context):
        built = super().build(layer_idx, dense, context)
        if self.options.upcycle_noise:
            import torch

            generator = torch.Generator().manual_seed(layer_seed(self.recipe.seed, layer_idx, SPLIT_STREAM))
            for name, tensor in built.tensors.items():
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
                scale = self.options.upcycle_noise * tensor.float().std()
                built.tensors[name] = (tensor.float() + scale * noise).to(tensor.dtype)
        return built

    def expert_size(self) -> int:
        return self.dense_config.intermediate_size

    @classmethod
    def default_score_scale(cls, num_experts: int, top_k: int) -> float:
        return 1.0  # the top-k weights sum to 1 and every expert equals the dense FFN

    def card_note(self) -> str:
        if self.options.upcycle_noise:
            return (
                f"Every expert is a copy of the dense FFN plus Gaussian noise ({self.options.upcycle_noise} of each "
                "weight's std), so the model is close to the dense model before training. Train it to let the "
                "experts diverge."
            )
        return (
            "Every expert is a copy of the dense FFN, so before training the model computes exactly what the dense "
            "model computes, whatever the router does. Train it (continual pre-training) to let the experts diverge."
        )

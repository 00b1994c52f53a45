"""Sparse upcycling (Komatsuzaki et al., 2023)."""

from ..registry import METHODS
from .base import SplitMethod


@METHODS.register("upcycle")
class Upcycle(SplitMethod):
    description = "Sparse upcycling: every expert is a full copy of the dense FFN."
    allows_shared_experts = False
    neuron_split = False  # every expert holds every neuron

    def split(self, layer_idx, dense, context):
        from ..experts import split_upcycle

        return split_upcycle(self.dense_config.intermediate_size, self.target.num_experts)

    def expert_size(self) -> int:
        return self.dense_config.intermediate_size

    @classmethod
    def default_score_scale(cls, num_experts: int, top_k: int) -> float:
        return 1.0  # the top-k weights sum to 1 and every expert equals the dense FFN

    def card_note(self) -> str:
        return (
            "Every expert is a copy of the dense FFN, so before training the model computes exactly what the dense "
            "model computes, whatever the router does. Train it (continual pre-training) to let the experts diverge."
        )

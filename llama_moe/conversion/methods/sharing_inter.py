"""LLaMA-MoE's Sharing-Inter construction."""

from ..registry import METHODS
from .base import CalibratedSplit
from .sharing_inner import text_group_importance


@METHODS.register("sharing-inter")
class SharingInterSplit(CalibratedSplit):
    description = (
        "LLaMA-MoE Sharing-Inter: neurons most groups rank important form the shared experts; the rest are assigned "
        "to routed experts by importance, without overlap."
    )
    gradient_pass = True

    def request_data(self, context) -> None:
        context.request_sequence_embeddings()

    def construct(self, context) -> dict:
        from .shared.importance import split_sharing_inter

        stats = text_group_importance(self, context)
        shared = self.target.num_shared_experts
        return {i: split_sharing_inter(stats[i].importance, shared) for i in self.target.layers}

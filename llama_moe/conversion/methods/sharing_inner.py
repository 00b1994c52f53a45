"""LLaMA-MoE's Sharing-Inner construction."""

from ..registry import METHODS
from .base import CalibratedSplit


def text_group_importance(method, context) -> dict:
    """Neuron importance per group of calibration texts: the sequences are clustered into one group per expert by
    their mean final hidden state (LLaMA-MoE clustered its texts by sentence embeddings; the dense model's own
    representation needs no other model), then a gradient pass sums |h * dL/dh| per group."""
    from .shared.importance import text_groups

    t = method.target
    groups = text_groups(context.sequence_embeddings(), t.num_experts, seed=method.recipe.seed)
    key = f"text-groups-{t.num_experts}"
    return context.importance(key, t.layers, sequence_groups=groups, num_groups=t.num_experts)


@METHODS.register("sharing-inner")
class SharingInnerSplit(CalibratedSplit):
    description = (
        "LLaMA-MoE Sharing-Inner: calibration texts clustered into N groups; expert i takes the neurons most important "
        "(|h * dL/dh|) for group i, so experts may share neurons."
    )
    gradient_pass = True
    allows_shared_experts = False

    def request_data(self, context) -> None:
        context.request_sequence_embeddings()

    def construct(self, context) -> dict:
        from .shared.importance import split_sharing_inner

        stats = text_group_importance(self, context)
        return {i: split_sharing_inner(stats[i].importance, self.expert_size()) for i in self.target.layers}

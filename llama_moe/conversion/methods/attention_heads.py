"""LLaMA-MoE v2's attention experts: groups of attention heads under grouped-query attention."""

from ..registry import METHODS
from ..target import ATTENTION, LayerBuild
from .base import ConstructionMethod

ATTENTION_KEYS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


@METHODS.register("attention_heads")
class AttentionHeads(ConstructionMethod):
    description = (
        "LLaMA-MoE v2 attention MoE: the query heads are cut, in order, into experts of whole KV groups or of heads "
        "within one; K/V stay dense, so the KV cache is the standard one."
    )
    target = ATTENTION

    @classmethod
    def default_score_scale(cls, num_experts: int, top_k: int) -> float:
        return float(top_k)  # with a near-uniform router the k kept experts get weight ~1, as in the dense model

    def build(self, layer_idx, dense, context) -> LayerBuild:
        # The experts are slices of the heads fixed by the config: the projections are kept as they are.
        missing = [key for key in ATTENTION_KEYS if key not in dense]
        if missing:
            raise ValueError(f"The dense attention lacks {missing}; expected LLaMA-style q/k/v/o projections.")
        return LayerBuild(dense=dense, tensors=dict(dense))

    def card_note(self) -> str:
        t = self.target
        return (
            f"Each token uses the query heads of {t.top_k} of {t.num_experts} attention experts in each attention-MoE "
            "layer, chosen by a router that was not trained (or fitted on calibration text), so quality is below the "
            "dense model until the routers are trained. With top-k equal to the number of attention experts, a zero "
            "router and attention score scale factor equal to that number it computes exactly the dense model."
        )

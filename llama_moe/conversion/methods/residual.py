"""LLaMA-MoE v2's residual MoE construction."""

from ..registry import METHODS
from .base import CalibratedSplit


@METHODS.register("residual")
class ResidualSplit(CalibratedSplit):
    description = (
        "LLaMA-MoE v2 residual MoE: the MLP inputs grouped by balanced k-means, each expert the neurons most "
        "important to its group's tokens, the most shared neurons the shared experts (its default router routes by "
        "the groups' centroids)."
    )
    gradient_pass = True
    default_router_init = "kmeans"  # v2 routes by the centroids its experts were built from

    @classmethod
    def default_score_scale(cls, num_experts: int, top_k: int) -> float:
        # Not LLaMA-MoE v1's N/k: v2's experts are each the neurons most important to their own token group, next to
        # an always-on shared expert, so N/k multiplies one expert's output by up to N. 1 + top-1 of 7 on SmolLM2:
        # 544,043x the dense perplexity with N/k = 7, 43.7x with 1 (benchmarks/reports/gmoefication.md, "The residual
        # default").
        return 1.0

    def request_data(self, context) -> None:
        context.request_mlp(self.target.layers)

    def construct(self, context) -> dict:
        from .shared.importance import router_groups, split_sharing_inter

        t = self.target
        routers = {i: context.kmeans_centroids(i, t.num_experts) for i in t.layers}
        stats = context.importance(
            f"kmeans-routers-{t.num_experts}", t.layers, token_groups=router_groups(routers), num_groups=t.num_experts
        )
        return {i: split_sharing_inter(stats[i].importance, t.num_shared_experts) for i in t.layers}

    def split_file_routers(self, context) -> dict | None:
        t = self.target
        if not context.has_kmeans_centroids(t.layers, t.num_experts):
            return None
        return {i: context.kmeans_centroids(i, t.num_experts) for i in t.layers}

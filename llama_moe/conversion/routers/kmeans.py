"""LLaMA-MoE v2's router: balanced k-means centroids of the MLP inputs."""

from ..registry import ROUTER_INITS
from ..target import MLP
from .base import RouterInit


@ROUTER_INITS.register("kmeans")
class KMeansRouter(RouterInit):
    description = "balanced k-means centroids of the calibration MLP inputs (LLaMA-MoE v2)"
    targets = (MLP,)

    def request(self, context) -> None:
        t = self.target
        if not context.has_kmeans_centroids(t.layers, t.num_experts):  # a split file may hold them
            context.request_mlp(t.layers)

    def tensors(self, layer_idx, built, context) -> dict:
        return {"weight": context.kmeans_centroids(layer_idx, self.target.num_experts)}

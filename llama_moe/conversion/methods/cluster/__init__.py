"""LLaMA-MoE's Independent-Clustering split, and G-MoEfication's clustering on activations."""

from dataclasses import dataclass

from ...registry import METHODS, option
from ..base import CalibratedSplit

CLUSTER_ON = ("gate", "up", "both", "activations")  # what --method cluster clusters


@dataclass(frozen=True)
class ClusterOptions:
    cluster_on: str = option(
        "both",
        "what --method cluster clusters: the neurons' gate, up or both weight rows, or their activations on "
        "calibration data (G-MoEfication)",
        choices=CLUSTER_ON,
    )


@METHODS.register("cluster")
class ClusterSplit(CalibratedSplit):
    description = (
        "LLaMA-MoE Independent-Clustering: balanced k-means of the FFN neurons (their L2-normalised weight rows, or "
        "their calibration activation profiles with cluster_on=activations); each cluster is an expert."
    )
    Options = ClusterOptions
    allows_shared_experts = False

    def request_data(self, context) -> None:
        if self.options.cluster_on == "activations":
            context.request_mlp(self.target.layers)

    def construct(self, context) -> dict:
        return {}  # each layer is clustered as the checkpoint streams: weight rows need no dense model

    def split(self, layer_idx, dense, context):
        if layer_idx not in self._splits:
            from .clustering import split_cluster

            activations = self.options.cluster_on == "activations"
            self._splits[layer_idx] = split_cluster(
                dense["gate_proj.weight"],
                dense["up_proj.weight"],
                self.target.num_experts,
                cluster_on=self.options.cluster_on,
                seed=self.recipe.seed,
                down_proj=dense["down_proj.weight"],
                calibration=context.mlp(layer_idx) if activations else None,
            )
        return self._splits[layer_idx]

    def info(self) -> dict:
        return {**super().info(), "cluster_on": self.options.cluster_on}

"""CMoE's carving: shared experts from the most often active neurons, routed experts by activation patterns."""

from dataclasses import dataclass

from ...registry import METHODS, option
from ..base import CalibratedSplit


@dataclass(frozen=True)
class CarveOptions:
    carve_active_neurons: int = option(
        10,
        "neurons counted as active on each calibration token: those with the largest |activation| (CMoE's K_a, "
        "10 in its code)",
    )


@METHODS.register("carve")
class CarveSplit(CalibratedSplit):
    description = (
        "CMoE carving: the neurons most often active on calibration tokens form the shared experts; the rest are "
        "grouped into equal routed experts by a balanced assignment of their activation patterns, each with a "
        "representative neuron for the analytical router."
    )
    Options = CarveOptions
    representative_neurons = True
    default_router_init = "analytical"  # CMoE's router, built from the representatives

    def request_data(self, context) -> None:
        context.request_mlp(self.target.layers)

    def construct(self, context) -> dict:
        return {}  # each layer is carved as the checkpoint streams, from its dense rows and calibration sample

    def split(self, layer_idx, dense, context):
        if layer_idx not in self._splits:
            from .carving import activation_markers, split_carve

            markers = activation_markers(
                context.mlp(layer_idx).hidden_states,
                dense["gate_proj.weight"],
                dense["up_proj.weight"],
                self.options.carve_active_neurons,
            )
            self._splits[layer_idx] = split_carve(markers, self.target.num_experts, self.target.num_shared_experts)
        return self._splits[layer_idx]

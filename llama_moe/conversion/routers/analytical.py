"""CMoE's analytical router: each routed expert is scored by the activation of its representative neuron."""

from ..registry import ROUTER_INITS
from ..target import MLP
from .base import RouterInit


@ROUTER_INITS.register("analytical")
class AnalyticalRouter(RouterInit):
    description = (
        "CMoE's analytical router: expert e scores a token by |silu(x . g_e) * (x . u_e)|, its representative "
        "neuron's activation with L2-normalised gate and up rows; the top-k win with weight 1 (needs --method carve)"
    )
    targets = (MLP,)
    router_type = "analytical"
    needs_neuron_split = True
    needs_representatives = True
    unit_weights = True

    def tensors(self, layer_idx, built, context) -> dict:
        import torch
        import torch.nn.functional as F

        representatives = built.split.representatives
        if representatives is None:
            raise ValueError(
                f"Layer {layer_idx}'s split has no representative neurons (a split file written by another method?); "
                "--router-init analytical needs a --method carve split."
            )
        rows = {name: built.dense[f"{name}_proj.weight"].float()[representatives] for name in ("gate", "up")}
        zeros = torch.zeros(self.target.num_experts)
        return {
            "weight": F.normalize(rows["up"], dim=1),
            "gate_weight": F.normalize(rows["gate"], dim=1),
            "weight_scale": zeros,  # CMoE's extra_scale: 0 gives unit weights (trained in its fine-tuning)
            "e_score_correction_bias": zeros.clone(),  # CMoE's extra_bias: 0 until its fine-tuning balances the load
        }

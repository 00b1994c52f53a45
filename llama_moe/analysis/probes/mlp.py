"""MoE MLP blocks (LlamaMoE, and AttnMoE's residual MLP MoE): token-choice routers, SwiGLU experts."""

import torch
import torch.nn.functional as F

from .base import (
    Probe,
    Routing,
    Site,
    capacity_dropped,
    fused_expert_weights,
    one_hot_load,
    register_probe,
    swiglu_expert,
)


@register_probe("mlp")
class MoEMLPProbe(Probe):
    @staticmethod
    def sites(model) -> list[Site]:
        from llama_moe_hf.modeling.modeling_llama_moe import LlamaMoESparseMoeBlock

        return [
            Site(
                f"layer {i} mlp", i, "mlp", layer.mlp, layer.mlp.gate, layer.mlp.gate.num_experts, layer.mlp.gate.top_k
            )
            for i, layer in enumerate(model.model.layers)
            if isinstance(layer.mlp, LlamaMoESparseMoeBlock)
        ]

    @staticmethod
    def routing(site: Site, gate_output: tuple) -> Routing:
        logits, _, index = gate_output  # [T, E], [T, k] weights, [T, k] experts (eval: token choice for every gate)
        probs = F.softmax(logits.float(), dim=-1)
        dropped = None
        if hasattr(site.gate, "capacity"):  # expert choice: what its training-time routing would leave unrouted
            dropped = capacity_dropped(probs, site.gate.capacity(probs.shape[0]))
        return Routing(probs, one_hot_load(index, site.num_experts), dropped)

    @staticmethod
    def expert_weights(site: Site) -> torch.Tensor:
        return fused_expert_weights(site.block.experts)

    @staticmethod
    def expert_outputs(site: Site, args: tuple, kwargs: dict, limit: int) -> torch.Tensor:
        states = args[0].reshape(-1, args[0].shape[-1])[:limit]  # [N, H]
        return torch.stack([swiglu_expert(site.block.experts, states, e) for e in range(site.num_experts)]).float()

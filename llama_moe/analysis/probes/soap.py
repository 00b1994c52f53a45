"""SoapMoE's SOAP layers: each segment routed by the previous one, its experts soft-merged by the routing weights."""

import torch
import torch.nn.functional as F

from .base import Probe, Routing, Site, fused_expert_weights, register_probe, swiglu_expert


@register_probe("soap")
class SoapProbe(Probe):
    load_name = "routing weight"

    @staticmethod
    def sites(model) -> list[Site]:
        from llama_moe_hf.modeling.modeling_soap_moe import SoapMoEBlock

        return [
            Site(
                f"layer {i} soap",
                i,
                "soap",
                layer.mlp,
                layer.mlp.gate,
                layer.mlp.gate.num_experts,
                layer.mlp.gate.top_k,
            )
            for i, layer in enumerate(model.model.layers)
            if isinstance(layer.mlp, SoapMoEBlock)
        ]

    @staticmethod
    def routing(site: Site, gate_output: tuple) -> Routing:
        logits, weights, _, _ = gate_output  # [.., E] logits; [.., E] merge weights (0 outside a top-k merge)
        num_experts = site.num_experts
        return Routing(F.softmax(logits.float(), dim=-1).reshape(-1, num_experts), weights.reshape(-1, num_experts))

    @staticmethod
    def expert_weights(site: Site) -> torch.Tensor:
        return fused_expert_weights(site.block.experts)

    @staticmethod
    def expert_outputs(site: Site, args: tuple, kwargs: dict, limit: int) -> torch.Tensor:
        """Each expert alone (unmerged) on the block's input tokens."""
        states = (args[0] if args else kwargs["hidden_states"]).reshape(-1, site.block.experts.gate_up_proj.shape[-1])
        states = states[:limit]  # [N, H]
        return torch.stack([swiglu_expert(site.block.experts, states, e) for e in range(site.num_experts)]).float()

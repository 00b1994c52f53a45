"""AttnMoE's attention experts: groups of query heads routed top-k per token (LLaMA-MoE v2)."""

import math

import torch
import torch.nn.functional as F

from .base import Probe, Routing, Site, one_hot_load, register_probe


@register_probe("attention")
class AttentionProbe(Probe):
    @staticmethod
    def sites(model) -> list[Site]:
        from llama_moe_hf.modeling.modeling_attn_moe import AttnMoEAttention

        return [
            Site(f"layer {i} attention", i, "attention", layer.self_attn, layer.self_attn.gate, *_experts(layer))
            for i, layer in enumerate(model.model.layers)
            if isinstance(layer.self_attn, AttnMoEAttention)
        ]

    @staticmethod
    def routing(site: Site, gate_output: tuple) -> Routing:
        logits, _, index = gate_output  # [T, E], [T, k], [T, k]
        return Routing(F.softmax(logits.float(), dim=-1), one_hot_load(index, site.num_experts))

    @staticmethod
    def expert_weights(site: Site) -> torch.Tensor:
        """Each expert's query rows and output columns (its own weights: K/V are shared within a KV group)."""
        attention, width = site.block, site.block.heads_per_expert * site.block.head_dim
        query = attention.q_proj.weight.view(site.num_experts, width, -1)  # [E, heads_e * D, H]
        output = attention.o_proj.weight.view(attention.o_proj.weight.shape[0], site.num_experts, width)  # [H, E, w]
        return torch.cat([query.flatten(1), output.transpose(0, 1).flatten(1)], dim=1).float()

    @staticmethod
    def expert_outputs(site: Site, args: tuple, kwargs: dict, limit: int) -> torch.Tensor:
        """Expert e's output is the attention with only e selected at weight 1, on whole sequences."""
        from llama_moe_hf.modeling.cache_compat import CACHE_ARG

        kwargs = dict(kwargs)
        states = args[0] if args else kwargs.pop("hidden_states")  # [B, S, H]
        rows = math.ceil(limit / states.shape[1])
        cos, sin = kwargs.pop("position_embeddings")
        mask = kwargs.pop("attention_mask", None)
        kwargs.pop(CACHE_ARG, None)  # the analysis must not write into a cache
        states, cos, sin = states[:rows], cos[:rows], sin[:rows]
        mask = mask[:rows] if mask is not None and mask.dim() > 1 else mask
        tokens = states.shape[0] * states.shape[1]
        outputs = []
        for e in range(site.num_experts):
            index = torch.full((tokens, 1), e, device=states.device)
            weights = torch.ones(tokens, 1, device=states.device, dtype=states.dtype)
            output, _ = site.block._forward_masked(states, (cos, sin), mask, None, weights, index, **kwargs)
            outputs.append(output.reshape(tokens, -1)[:limit])
        return torch.stack(outputs).float()  # [E, N, H]


def _experts(layer) -> tuple[int, int]:
    return layer.self_attn.num_experts, layer.self_attn.gate.top_k

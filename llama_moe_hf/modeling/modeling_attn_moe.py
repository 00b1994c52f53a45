"""AttnMoE: LLaMA with Mixture-of-Experts attention heads (LLaMA-MoE v2), optionally with LlamaMoE's MLP MoE.

The query heads of a layer are cut, in order, into experts; a router picks the top-k experts per token, and

    output = attention_score_scale_factor * sum_{e in top-k} w_e * o_proj[:, heads_e](attention over heads_e)

which is exactly the dense attention when every expert is selected with unit weight.

What a token attends to: K/V are computed for every token and every KV head, so each selected head of a token
attends to all earlier tokens, as in the dense model. The KV cache is the standard `DynamicCache`, and masks, padding,
sdpa/eager/flash attention and generation are those of LLaMA. (The LLaMA-MoE v2 code instead lets a token see only
earlier tokens routed to the same expert, with per-expert ragged caches.) Routing is applied to the per-head outputs
before `o_proj`; docs/attn_moe.md says which compute this saves.

    AttnMoEAttention     LlamaAttention + router `gate`; weights each head's output by its expert's routing weight
    AttnMoEDecoderLayer  LlamaMoE decoder layer (dense or MoE MLP) with AttnMoE attention in `attention_moe_layers`
    AttnMoEModel         LlamaMoE backbone that also reports the attention routers' logits
    AttnMoEForCausalLM   causal LM; the aux loss covers the attention and the MLP routers

This file is copied next to saved checkpoints (remote code): it imports only transformers, torch and the other
files of this folder.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    apply_rotary_pos_emb,
    eager_attention_forward,
    rotate_half,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

from .configuration_attn_moe import AttnMoEConfig
from .modeling_llama_moe import (
    LlamaMoEDecoderLayer,
    LlamaMoEForCausalLM,
    LlamaMoEModel,
    LlamaMoEPreTrainedModel,
    LlamaMoERouter,
)


@dataclass
class AttnMoEModelOutputWithPast(MoeModelOutputWithPast):
    r"""
    router_logits (`tuple(torch.Tensor)`): per MoE layer `[tokens, config.num_experts]`: the MLP routers, or the
        attention routers when the MLP is dense (what `load_balancing_loss_func` and TRL read).
    attention_router_logits (`tuple(torch.Tensor)`): per attention-MoE layer `[tokens, num_attention_experts]`.
    """

    attention_router_logits: tuple[torch.Tensor, ...] | None = None


@dataclass
class AttnMoECausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""
    attention_router_logits (`tuple(torch.Tensor)`): per attention-MoE layer `[tokens, num_attention_experts]`.
    """

    attention_router_logits: tuple[torch.Tensor, ...] | None = None


class AttnMoEAttention(LlamaAttention):
    """LLaMA attention whose query heads form `num_attention_experts` experts of consecutive heads, top-k routed.

    Parameters are LlamaAttention's (`q_proj`, `k_proj`, `v_proj`, `o_proj`, so a dense checkpoint loads as is) plus
    the router `gate.weight` `[E, H]`. Expert e owns query heads `[e * n, (e + 1) * n)`, `n = heads / E`: whole KV
    groups or part of one (the config checks that no expert splits a KV group).
    """

    def __init__(self, config: AttnMoEConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.num_experts = config.num_attention_experts
        self.heads_per_expert = config.heads_per_attention_expert
        self.score_scale_factor = config.layer_attention_score_scale(layer_idx)
        self.gate = LlamaMoERouter(
            config,
            num_experts=config.num_attention_experts,
            top_k=config.num_attention_experts_per_tok,
            router_type=config.attention_router_type,
        )

    def head_weights(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Routing weight of every query head for every token, `[tokens, heads]`: scale * w_e on the heads of each
        selected expert e, 0 elsewhere."""
        _, top_k_weights, top_k_index = self.gate(hidden_states)  # [T, k]
        num_tokens = top_k_index.shape[0]
        expert_weights = top_k_weights.new_zeros(num_tokens, self.num_experts)
        expert_weights = expert_weights.scatter(1, top_k_index, top_k_weights * self.score_scale_factor)  # [T, E]
        return expert_weights.repeat_interleave(self.heads_per_expert, dim=1)  # [T, heads]

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, S, H]
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._can_gather(kwargs):
            return self._forward_gathered(hidden_states, position_embeddings, attention_mask, past_key_values), None
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        # LlamaAttention's computation, unchanged up to o_proj: K/V for every token keep the standard cache.
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )  # attn_output: [B, S, heads, head_dim]

        # Weighting each head before o_proj == sum over experts of w_e * (their heads through their o_proj columns).
        head_weights = self.head_weights(hidden_states).view(*input_shape, -1, 1)  # [B, S, heads, 1]
        attn_output = attn_output * head_weights.to(attn_output.dtype)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    def _can_gather(self, kwargs) -> bool:
        # The gathered path slices the projection weights and calls sdpa itself, so wrapped projections (LoRA,
        # quantized), other kernels, attention dropout and returned attention weights use the masked path.
        return (
            self.config.attention_experts_implementation == "gathered"
            and self.config._attn_implementation in ("sdpa", "eager")
            and type(self.q_proj) is nn.Linear
            and type(self.o_proj) is nn.Linear
            and not (self.training and self.attention_dropout > 0)
            and not kwargs.get("output_attentions")
        )

    def _forward_gathered(
        self,
        hidden_states: torch.Tensor,  # [B, S, H]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,  # [B, 1, S, K] bool or additive, or None (causal, no padding)
        past_key_values: Cache | None,
    ) -> torch.Tensor:
        """q_proj, attention and o_proj only for the selected (token, expert) pairs; K/V for every token."""
        batch_size, seq_len, hidden_size = hidden_states.shape
        hidden_shape = (batch_size, seq_len, -1, self.head_dim)
        cos, sin = (t.expand(batch_size, -1, -1) for t in position_embeddings)  # [B, S, D] (may come as [1, S, D])
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, kv, S, D]
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = key_states * cos[:, None] + rotate_half(key_states) * sin[:, None]
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        num_keys = key_states.shape[2]

        if attention_mask is None:  # causal: the query at position t sees the keys up to past + t
            query_positions = torch.arange(seq_len, device=hidden_states.device) + (num_keys - seq_len)
            key_positions = torch.arange(num_keys, device=hidden_states.device)
            attention_mask = (key_positions[None, :] <= query_positions[:, None]).expand(batch_size, 1, -1, -1)
        attention_mask = attention_mask[..., :num_keys]
        if attention_mask.dtype == torch.bool:
            # Additive, so a fully masked row (a padding query) gives finite garbage rather than NaN.
            min_value = torch.finfo(hidden_states.dtype).min
            attention_mask = torch.zeros_like(attention_mask, dtype=hidden_states.dtype).masked_fill(
                ~attention_mask, min_value
            )

        flat_states = hidden_states.reshape(-1, hidden_size)  # [T, H], T = B*S
        _, top_k_weights, top_k_index = self.gate(flat_states)  # [T, k]
        top_k_weights = (top_k_weights * self.score_scale_factor).to(hidden_states.dtype)
        output = torch.zeros_like(flat_states)
        width = self.heads_per_expert * self.head_dim
        kv_heads = max(1, self.heads_per_expert // self.num_key_value_groups)  # KV heads one expert reads
        for expert in top_k_index.unique().tolist():
            columns = slice(expert * width, (expert + 1) * width)
            first_kv = expert * self.heads_per_expert // self.num_key_value_groups
            is_expert = top_k_index == expert  # [T, k]
            tokens = is_expert.any(dim=-1).nonzero().squeeze(-1)  # [n]
            weights = (top_k_weights * is_expert).sum(dim=-1)[tokens]  # [n]
            rows, positions = tokens // seq_len, tokens % seq_len
            q_bias = None if self.q_proj.bias is None else self.q_proj.bias[columns]
            query = F.linear(flat_states[tokens], self.q_proj.weight[columns], q_bias)  # [n, heads_e * D]
            query = query.view(-1, self.heads_per_expert, self.head_dim)  # [n, heads_e, D]
            query = query * cos[rows, positions, None] + rotate_half(query) * sin[rows, positions, None]
            for row in rows.unique().tolist():  # one attention call per sequence: its own keys and mask rows
                in_row = (rows == row).nonzero().squeeze(-1)
                row_output = F.scaled_dot_product_attention(
                    query[in_row].transpose(0, 1)[None],  # [1, heads_e, m, D]
                    key_states[row, first_kv : first_kv + kv_heads][None],  # [1, kv_e, K, D]
                    value_states[row, first_kv : first_kv + kv_heads][None],
                    attn_mask=attention_mask[row, :, positions[in_row]][None],  # [1, 1, m, K]
                    scale=self.scaling,
                    enable_gqa=True,
                )[0].transpose(0, 1)  # [m, heads_e, D]
                expert_output = F.linear(row_output.reshape(len(in_row), width), self.o_proj.weight[:, columns])
                output.index_add_(0, tokens[in_row], expert_output * weights[in_row, None])
        if self.o_proj.bias is not None:
            output = output + self.o_proj.bias
        return output.view(batch_size, seq_len, hidden_size)


class AttnMoEDecoderLayer(LlamaMoEDecoderLayer):
    """LlamaMoE decoder layer (dense or MoE MLP by `moe_layers`) with AttnMoE attention in `attention_moe_layers`."""

    def __init__(self, config: AttnMoEConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if layer_idx in config.attention_moe_layers:
            self.self_attn = AttnMoEAttention(config, layer_idx)


class AttnMoEPreTrainedModel(LlamaMoEPreTrainedModel):
    config: AttnMoEConfig
    config_class = AttnMoEConfig
    _no_split_modules = ["AttnMoEDecoderLayer"]
    # Both router kinds are LlamaMoERouter; where they sit tells them apart.
    _can_record_outputs = {
        "router_logits": OutputRecorder(LlamaMoERouter, index=0, layer_name="mlp.gate"),
        "attention_router_logits": OutputRecorder(LlamaMoERouter, index=0, layer_name="self_attn.gate"),
        "hidden_states": AttnMoEDecoderLayer,
        "attentions": LlamaAttention,
    }


class AttnMoEModel(AttnMoEPreTrainedModel, LlamaMoEModel):
    """LlamaMoE's backbone (its forward is reused) built from AttnMoE decoder layers."""

    decoder_layer_class = AttnMoEDecoderLayer

    @can_return_tuple
    def forward(self, *args, output_router_logits: bool | None = None, **kwargs) -> AttnMoEModelOutputWithPast:
        r"""
        Same arguments as `LlamaMoEModel.forward`. With `output_router_logits`, `router_logits` holds the routers
        with `config.num_experts` experts (the MLP routers, or the attention routers when the MLP is dense) and
        `attention_router_logits` the attention routers.
        """
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs = super().forward(
            *args,
            output_router_logits=output_router_logits,
            output_attention_router_logits=output_router_logits,
            return_dict=True,
            **kwargs,
        )
        outputs = AttnMoEModelOutputWithPast(**outputs)
        if output_router_logits and not self.config.moe_layers:
            outputs.router_logits = outputs.attention_router_logits
        return outputs


class AttnMoEForCausalLM(AttnMoEPreTrainedModel, LlamaMoEForCausalLM):
    def __init__(self, config: AttnMoEConfig):
        AttnMoEPreTrainedModel.__init__(self, config)  # not LlamaMoEForCausalLM.__init__ (LlamaMoE backbone)
        self.model = AttnMoEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def router_losses(self, outputs, attention_mask):
        """The attention routers' load-balancing loss plus the MLP routers', each with its own expert count and top-k;
        the z-loss runs over all routers."""
        config = self.config
        groups = [(outputs.attention_router_logits, config.num_attention_experts, config.num_attention_experts_per_tok)]
        if config.moe_layers:  # else `router_logits` are the attention routers again
            groups.append((outputs.router_logits, config.num_experts, config.num_experts_per_tok))
        groups = [(logits, e, k) for logits, e, k in groups if logits]
        if not groups:
            return None, ()
        aux_loss = sum(load_balancing_loss_func(logits, e, k, attention_mask) for logits, e, k in groups)
        return aux_loss, tuple(t for logits, _, _ in groups for t in logits)

    def causal_lm_output(self, outputs, **fields) -> AttnMoECausalLMOutputWithPast:
        return AttnMoECausalLMOutputWithPast(
            **super().causal_lm_output(outputs, **fields), attention_router_logits=outputs.attention_router_logits
        )


__all__ = ["AttnMoEAttention", "AttnMoEForCausalLM", "AttnMoEModel", "AttnMoEPreTrainedModel"]

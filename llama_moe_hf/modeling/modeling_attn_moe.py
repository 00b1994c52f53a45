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
    heads                AttnMoEForCausalLM, AttnMoEForSequenceClassification, AttnMoEForTokenClassification,
                         AttnMoEForQuestionAnswering

Router losses follow LlamaMoE's rule: `router_logits` (the MLP routers, or the attention routers when the MLP is
dense) give the standard balance term that the head or TRL adds; the attention routers' balance loss (when they are
not in `router_logits`) and every router's z-loss and MI loss are attached to the graph in training.

This file is copied next to saved checkpoints (remote code): it imports only transformers, torch and the other
files of this folder.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
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
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.import_utils import is_torchdynamo_compiling
from transformers.utils.output_capturing import OutputRecorder

from .cache_compat import accepts_past_key_values
from .configuration_attn_moe import AttnMoEConfig
from .modeling_llama_moe import (
    LlamaMoEDecoderLayer,
    LlamaMoEForCausalLM,
    LlamaMoEForQuestionAnswering,
    LlamaMoEForSequenceClassification,
    LlamaMoEForTokenClassification,
    LlamaMoEModel,
    LlamaMoEPreTrainedModel,
)
from .moe_kernels import expert_one_hot
from .router_losses import attach_router_loss, router_losses
from .routers import ROUTER_CLASSES, LlamaMoERouter

logger = logging.get_logger(__name__)


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
    attention_aux_loss (`torch.Tensor`): the attention routers' balance loss when the MLP is an MoE too (then it is
        not part of `aux_loss`; training attaches it to the graph).
    """

    attention_router_logits: tuple[torch.Tensor, ...] | None = None
    attention_aux_loss: torch.Tensor | None = None


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
        self.z_loss_weight = config.router_z_loss_coef / config.num_router_layers
        self.mi_loss_weight = config.router_mi_loss_coef / config.num_router_layers
        self.gate = ROUTER_CLASSES[config.attention_router_type](
            config, num_experts=config.num_attention_experts, top_k=config.num_attention_experts_per_tok
        )

    @accepts_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, S, H]
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        router_logits, top_k_weights, top_k_index = self.gate(hidden_states)  # [T, E], [T, k], [T, k]
        top_k_weights = top_k_weights * self.score_scale_factor
        if self._can_gather(kwargs, cache):
            attn_weights = None
            attn_output = self._forward_gathered(
                hidden_states, position_embeddings, attention_mask, cache, top_k_weights, top_k_index
            )
        else:
            attn_output, attn_weights = self._forward_masked(
                hidden_states,
                position_embeddings,
                attention_mask,
                cache,
                top_k_weights,
                top_k_index,
                **kwargs,
            )
        if self.z_loss_weight or self.mi_loss_weight:
            loss = router_losses(router_logits, self.z_loss_weight, self.mi_loss_weight)
            attn_output = attach_router_loss(self, attn_output, loss)
        return attn_output, attn_weights

    def _forward_masked(
        self, hidden_states, position_embeddings, attention_mask, cache, top_k_weights, top_k_index, **kwargs
    ):
        """LlamaAttention's computation, with each head's output weighted by its expert's weight before o_proj."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        # K/V for every token keep the standard cache.
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

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
        expert_weights = (top_k_weights[..., None] * expert_one_hot(top_k_index, self.num_experts)).sum(1)  # [T, E]
        head_weights = expert_weights.repeat_interleave(self.heads_per_expert, dim=1)  # [T, heads]
        attn_output = attn_output * head_weights.view(*input_shape, -1, 1).to(attn_output.dtype)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def _can_gather(self, kwargs, cache) -> bool:
        # The gathered path slices the projection weights, calls sdpa itself and builds its own causal mask for the
        # keys it holds, so wrapped projections (LoRA, quantized), other kernels, attention dropout, returned
        # attention weights, fixed-size (static) caches and torch.compile (routing-dependent shapes) use the masked
        # path.
        return (
            self.config.attention_experts_implementation == "gathered"
            and self.config._attn_implementation in ("sdpa", "eager")
            and type(self.q_proj) is nn.Linear
            and type(self.o_proj) is nn.Linear
            and not (self.training and self.attention_dropout > 0)
            and not (kwargs.get("output_attentions") or self.config.output_attentions)
            and not (cache is not None and cache.is_compileable)
            and not is_torchdynamo_compiling()
        )

    def _forward_gathered(
        self,
        hidden_states: torch.Tensor,  # [B, S, H]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,  # [B, 1, S, K] bool or additive, or None (causal, no padding)
        cache: Cache | None,
        top_k_weights: torch.Tensor,  # [T, k], T = B*S
        top_k_index: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:
        """q_proj, attention and o_proj only for the selected (token, expert) pairs; K/V for every token."""
        batch_size, seq_len, hidden_size = hidden_states.shape
        hidden_shape = (batch_size, seq_len, -1, self.head_dim)
        cos, sin = (t.expand(batch_size, -1, -1) for t in position_embeddings)  # [B, S, D] (may come as [1, S, D])
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, kv, S, D]
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = key_states * cos[:, None] + rotate_half(key_states) * sin[:, None]
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        attention_mask = self._gathered_mask(attention_mask, batch_size, seq_len, key_states.shape[2], hidden_states)

        flat_states = hidden_states.reshape(-1, hidden_size)  # [T, H]
        top_k_weights = top_k_weights.to(hidden_states.dtype)
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

    @staticmethod
    def _gathered_mask(attention_mask, batch_size, seq_len, num_keys, hidden_states) -> torch.Tensor:
        """`[B, 1, S, K]` additive mask (a fully masked padding query gives finite garbage rather than NaN)."""
        if attention_mask is None:  # causal: the query at position t sees the keys up to past + t
            query_positions = torch.arange(seq_len, device=hidden_states.device) + (num_keys - seq_len)
            key_positions = torch.arange(num_keys, device=hidden_states.device)
            attention_mask = (key_positions[None, :] <= query_positions[:, None]).expand(batch_size, 1, -1, -1)
        attention_mask = attention_mask[..., :num_keys]
        if attention_mask.dtype == torch.bool:
            min_value = torch.finfo(hidden_states.dtype).min
            attention_mask = torch.zeros_like(attention_mask, dtype=hidden_states.dtype).masked_fill(
                ~attention_mask, min_value
            )
        return attention_mask


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
    auto_heads = {
        "AutoModel": "AttnMoEModel",
        "AutoModelForCausalLM": "AttnMoEForCausalLM",
        "AutoModelForSequenceClassification": "AttnMoEForSequenceClassification",
        "AutoModelForTokenClassification": "AttnMoEForTokenClassification",
        "AutoModelForQuestionAnswering": "AttnMoEForQuestionAnswering",
    }
    # Both router kinds are LlamaMoERouter; where they sit tells them apart.
    _can_record_outputs = {
        "router_logits": OutputRecorder(LlamaMoERouter, index=0, layer_name="mlp.gate"),
        "attention_router_logits": OutputRecorder(LlamaMoERouter, index=0, layer_name="self_attn.gate"),
        "hidden_states": AttnMoEDecoderLayer,
        "attentions": "self_attn",
    }

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # The switch picks the MLP experts' kernel. With every MLP dense there is none to run: it is accepted and
        # changes nothing, as transformers' contract has it (any kernel may be set, and the outputs agree); the log
        # says so once. The attention experts have attention_experts_implementation.
        if requested_experts not in (None, "eager", "llama_moe_auto") and not self.config.moe_layers:
            logger.warning_once(
                f"experts_implementation={requested_experts!r} picks the kernel of MLP experts, and this AttnMoE model "
                "has none (moe_layers is empty): it changes nothing. The attention experts' computation is chosen by "
                "attention_experts_implementation."
            )
        return super().get_correct_experts_implementation(requested_experts)


class AttnMoEModel(AttnMoEPreTrainedModel, LlamaMoEModel):
    """LlamaMoE's backbone (its forward is reused) built from AttnMoE decoder layers."""

    decoder_layer_class = AttnMoEDecoderLayer

    @can_return_tuple
    @accepts_past_key_values
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> AttnMoEModelOutputWithPast:
        r"""
        With `output_router_logits`, `router_logits` holds the routers with `config.num_experts` experts (the MLP
        routers, or the attention routers when the MLP is dense) and `attention_router_logits` the attention routers.
        """
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        # With an MLP MoE the attention routers are not in `router_logits`: their balance loss goes into the graph.
        balance_in_graph = (
            self.training
            and torch.is_grad_enabled()
            and bool(self.config.moe_layers)
            and self.config.router_aux_loss_coef > 0
        )
        outputs = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            output_attention_router_logits=output_router_logits or balance_in_graph,
            return_dict=True,
            **kwargs,
        )
        outputs = AttnMoEModelOutputWithPast(**outputs)
        if balance_in_graph and outputs.attention_router_logits:
            loss = self.config.router_aux_loss_coef * self.attention_balance_loss(outputs, attention_mask)
            outputs.last_hidden_state = attach_router_loss(self, outputs.last_hidden_state, loss)
        if output_router_logits and not self.config.moe_layers:
            outputs.router_logits = outputs.attention_router_logits
        if not output_router_logits:
            outputs.attention_router_logits = None
        return outputs

    def attention_balance_loss(self, outputs, attention_mask) -> torch.Tensor:
        """The attention routers' Switch load-balancing loss (unweighted)."""
        config = self.config
        return load_balancing_loss_func(
            outputs.attention_router_logits,
            config.num_attention_experts,
            config.num_attention_experts_per_tok,
            attention_mask,
        )


class AttnMoEForCausalLM(AttnMoEPreTrainedModel, LlamaMoEForCausalLM, GenerationMixin):
    backbone_class = AttnMoEModel

    def causal_lm_output(self, outputs, attention_mask, **fields) -> AttnMoECausalLMOutputWithPast:
        attention_aux_loss = None
        if outputs.attention_router_logits and self.config.moe_layers:
            attention_aux_loss = self.model.attention_balance_loss(outputs, attention_mask)
        return AttnMoECausalLMOutputWithPast(
            **super().causal_lm_output(outputs, attention_mask, **fields),
            attention_router_logits=outputs.attention_router_logits,
            attention_aux_loss=attention_aux_loss,
        )

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """`generate` compiles only on a CPU (where it asks to): compiled for an H200, the decoding step gave wrong
        logits from the third layer on (relative error 0.41, top-1 agreement 0), with sdpa's fused kernel, with its
        math backend chosen inside the graph, or with eager attention on sdpa's mask, so a static cache there decodes
        eagerly (benchmarks/reports/gpu-h200.md)."""
        return self.device.type == "cpu" and super()._valid_auto_compile_criteria(model_kwargs, generation_config)


class AttnMoEForSequenceClassification(AttnMoEPreTrainedModel, LlamaMoEForSequenceClassification):
    backbone_class = AttnMoEModel


class AttnMoEForTokenClassification(AttnMoEPreTrainedModel, LlamaMoEForTokenClassification):
    backbone_class = AttnMoEModel


class AttnMoEForQuestionAnswering(AttnMoEPreTrainedModel, LlamaMoEForQuestionAnswering):
    backbone_class = AttnMoEModel


__all__ = [
    "AttnMoEAttention",
    "AttnMoEForCausalLM",
    "AttnMoEForQuestionAnswering",
    "AttnMoEForSequenceClassification",
    "AttnMoEForTokenClassification",
    "AttnMoEModel",
    "AttnMoEPreTrainedModel",
]

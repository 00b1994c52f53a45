"""LlamaMoE: LLaMA with Mixture-of-Experts feed-forward blocks (LLaMA-MoE v1/v2, sparse upcycling).

Attention, norms and rotary embeddings are transformers' own LLaMA modules; only the MoE parts are new:

    LlamaMoERouter        hidden states -> (router_logits, top-k weights, top-k expert ids), float32 math
    LlamaMoEExperts       fused expert weights + the grouped expert compute (`@use_experts_implementation`)
    LlamaMoESparseMoeBlock router + experts (+ always-on shared experts), LLaMA-MoE score scaling
    LlamaMoEDecoderLayer  LLaMA decoder layer whose MLP is dense or MoE (`config.moe_layers`)

This file is copied next to saved checkpoints (remote code): it imports only transformers, torch and
`.configuration_llama_moe`.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_llama_moe import LlamaMoEConfig

# Default expert compute: while no expert gets more than this many (token, expert) rows, one batched matmul over
# zero-padded per-expert rows beats a loop of small per-expert matmuls (16 experts x 256 neurons, top-4, on CPU:
# inputs of up to ~400 tokens; docs/benchmarks.md).
BMM_MAX_ROWS_PER_EXPERT = 128


def router_z_loss_func(router_logits: tuple[torch.Tensor, ...] | None) -> torch.Tensor | int:
    """ST-MoE router z-loss: mean over tokens and layers of logsumexp(logits)^2 (keeps router logits small)."""
    if not router_logits:
        return 0
    return torch.stack([torch.logsumexp(logits.float(), dim=-1).square().mean() for logits in router_logits]).mean()


class LlamaMoERouter(nn.Module):
    """Token-choice top-k router. Returns `(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])`.

    `router_type="selector"` is MoEfication's expert selector: scores = `Linear(E, E)(tanh(Linear(H, E)(x)))`, the
    top-k scores win, and every winner gets weight 1 (straight-through: gradients flow through sigmoid(score)).
    """

    def __init__(
        self,
        config: LlamaMoEConfig,
        num_experts: int | None = None,
        top_k: int | None = None,
        router_type: str | None = None,
    ):
        # The overrides route something other than the MLP experts (AttnMoE's attention-head experts).
        super().__init__()
        self.router_type = router_type or config.router_type
        self.top_k = top_k or config.num_experts_per_tok
        self.num_experts = num_experts or config.num_experts
        self.hidden_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))
        if self.router_type == "noisy_top_k":
            # Learned per-expert noise scale, softplus(x W_noise) (Shazeer et al., 2017).
            self.noise_weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))
        if self.router_type == "selector":
            self.bias = nn.Parameter(torch.empty(self.num_experts))
            self.selector = nn.Linear(self.num_experts, self.num_experts)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim).float()
        if self.router_type == "selector":
            hidden_states = torch.tanh(F.linear(hidden_states, self.weight.float(), self.bias.float()))  # [T, E]
            router_logits = F.linear(hidden_states, self.selector.weight.float(), self.selector.bias.float())
            top_k_index = torch.topk(router_logits, self.top_k, dim=-1).indices  # [T, k]
            probs = torch.sigmoid(router_logits.gather(1, top_k_index))
            return router_logits, probs - probs.detach() + 1, top_k_index  # weights: exactly 1 forward
        router_logits = F.linear(hidden_states, self.weight.float())  # [T, E]
        if self.router_type == "noisy_top_k" and self.training:
            noise_std = F.softplus(F.linear(hidden_states, self.noise_weight.float()))
            router_logits = router_logits + torch.randn_like(router_logits) * noise_std
        router_probs = F.softmax(router_logits, dim=-1)
        top_k_weights, top_k_index = torch.topk(router_probs, self.top_k, dim=-1)  # [T, k]
        if self.router_type != "switch":
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        return router_logits, top_k_weights, top_k_index


@use_experts_implementation
class LlamaMoEExperts(nn.Module):
    """Routed experts stored as fused 3-D tensors: `gate_up_proj [E, 2m, H]` (gate rows first), `down_proj [E, H, m]`."""

    def __init__(self, config: LlamaMoEConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    def _expert(self, states: torch.Tensor, expert_idx: int) -> torch.Tensor:
        """SwiGLU of one expert on `[n, H]` rows, through views of the fused weights (no copy)."""
        gate, up = F.linear(states, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)  # [n, m] each
        return F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])  # [n, H]

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        top_k_index: torch.Tensor,  # [T, k]
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:
        weights = top_k_weights.to(hidden_states.dtype)
        if top_k_index.numel() <= self.num_experts:
            # Few (token, expert) pairs, as in decoding: run them one by one. No sort, scatter or zero-filled output,
            # whose fixed cost would dominate here; each selected expert's weights are still read only once.
            rows = [
                weights[token_idx] @ torch.cat([self._expert(hidden_states[token_idx, None], e) for e in expert_ids])
                for token_idx, expert_ids in enumerate(top_k_index.tolist())
            ]  # T x [H]
            return torch.stack(rows)

        # Group the S = T*k (token, expert) pairs by expert with one argsort and a single host sync (the counts).
        top_k = top_k_index.shape[-1]
        flat_index = top_k_index.reshape(-1)  # [S]
        sorted_experts, order = flat_index.sort()  # [S] each
        counts = torch.bincount(flat_index, minlength=self.num_experts)  # [E]
        counts_list = counts.tolist()
        token_index = order // top_k  # [S]
        sorted_weights = weights.reshape(-1, 1).index_select(0, order)  # [S, 1]
        output = torch.zeros_like(hidden_states)  # [T, H]

        capacity = max(counts_list)
        if capacity <= BMM_MAX_ROWS_PER_EXPERT:
            # Prompts: expert e's rows fill rows [e * C, (e + 1) * C) of a padded layout, C = the largest count, and
            # each projection is one batched matmul over all experts: a loop of small per-expert matmuls runs far
            # below GEMM speed. Padding rows repeat token 0 with weight 0: computed, but they add nothing.
            first_of_expert = counts.cumsum(0) - counts  # [E]
            slot = torch.arange(order.numel(), device=order.device) - first_of_expert[sorted_experts]  # [S]
            padded_rows = sorted_experts * capacity + slot  # [S]
            row_token = token_index.new_zeros(self.num_experts * capacity).index_copy_(0, padded_rows, token_index)
            row_weight = weights.new_zeros(self.num_experts * capacity, 1).index_copy(0, padded_rows, sorted_weights)
            padded = hidden_states.index_select(0, row_token).view(self.num_experts, capacity, -1)  # [E, C, H]
            gate, up = torch.bmm(padded, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, C, m] each
            expert_output = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))  # [E, C, H]
            return output.index_add_(0, row_token, expert_output.view(row_token.numel(), -1) * row_weight)

        # Long inputs: each expert gathers only its own rows, so the working set stays cache-sized (one gather of all
        # S rows is slower on CPU), and adds its weighted output back in place.
        start = 0
        for expert_idx, count in enumerate(counts_list):
            if count == 0:
                continue
            end = start + count
            tokens = token_index[start:end]  # [n]
            expert_output = self._expert(hidden_states.index_select(0, tokens), expert_idx)  # [n, H]
            output.index_add_(0, tokens, expert_output * sorted_weights[start:end])
            start = end
        return output


class LlamaMoESharedExperts(nn.Module):
    """Always-on shared experts, fused into one SwiGLU MLP of `num_shared_experts * shared_expert_intermediate_size`."""

    def __init__(self, config: LlamaMoEConfig):
        super().__init__()
        intermediate_size = config.num_shared_experts * config.shared_expert_intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class LlamaMoESparseMoeBlock(nn.Module):
    """output = score_scale_factor * sum_{e in top-k} w_e * expert_e(x)  [+ shared_experts(x)]
    [+ sum_{e not in top-k} compensation_e  (G-MoEfication, `config.moe_compensation`)]"""

    def __init__(self, config: LlamaMoEConfig, layer_idx: int):
        super().__init__()
        self.score_scale_factor = config.layer_score_scale(layer_idx)
        self.gate = LlamaMoERouter(config)
        self.experts = LlamaMoEExperts(config)
        self.shared_experts = LlamaMoESharedExperts(config) if config.num_shared_experts > 0 else None
        # G-MoEfication representative values: row e stands in for expert e's output when it is not selected.
        self.compensation = (
            nn.Parameter(torch.zeros(config.num_experts, config.hidden_size)) if config.moe_compensation else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        flat_states = hidden_states.view(-1, hidden_dim)  # [T, H]
        _, top_k_weights, top_k_index = self.gate(flat_states)
        output = self.experts(flat_states, top_k_index, top_k_weights * self.score_scale_factor)
        if self.compensation is not None:
            # 0/1 mask of the unselected experts: exactly zero when all are selected. [T, E] @ [E, H] -> [T, H]
            unselected = self.compensation.new_ones(top_k_index.shape[0], self.compensation.shape[0])
            unselected = unselected.scatter_(1, top_k_index, 0.0)
            output = output + (unselected @ self.compensation).to(output.dtype)
        if self.shared_experts is not None:
            output = output + self.shared_experts(flat_states)
        return output.view(batch_size, sequence_length, hidden_dim)


class LlamaMoEDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: LlamaMoEConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMoESparseMoeBlock(config, layer_idx) if layer_idx in config.moe_layers else LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaMoEPreTrainedModel(PreTrainedModel):
    config: LlamaMoEConfig
    config_class = LlamaMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaMoEDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = False  # the expert loop has data-dependent shapes
    _supports_attention_backend = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(LlamaMoERouter, index=0),
        "hidden_states": LlamaMoEDecoderLayer,
        "attentions": LlamaAttention,
    }

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # transformers would default to grouped_mm; our eager forward is faster on CPU for decoding and long inputs
        # and needs no special kernel (docs/benchmarks.md, "MoE layer forward speed").
        return super().get_correct_experts_implementation(requested_experts or "eager")

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, LlamaMoEExperts):
            nn.init.normal_(module.gate_up_proj, mean=0.0, std=std)
            nn.init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, LlamaMoERouter):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if hasattr(module, "noise_weight"):
                nn.init.zeros_(module.noise_weight)
            if hasattr(module, "selector"):
                nn.init.zeros_(module.bias)
        elif isinstance(module, LlamaMoESparseMoeBlock) and module.compensation is not None:
            nn.init.zeros_(module.compensation)


class LlamaMoEModel(LlamaMoEPreTrainedModel):
    decoder_layer_class = LlamaMoEDecoderLayer  # AttnMoE swaps in its own layers and reuses the rest

    def __init__(self, config: LlamaMoEConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [self.decoder_layer_class(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


class LlamaMoEForCausalLM(LlamaMoEPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: LlamaMoEConfig):
        super().__init__(config)
        self.model = LlamaMoEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        r"""
        `aux_loss` is the (unweighted) load-balancing loss of Switch/Mixtral over the MoE layers; with `labels`,
        `loss = lm_loss + router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss`.
        """
        output_router_logits = (
            output_router_logits if output_router_logits is not None else self.config.output_router_logits
        )
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        aux_loss = None
        if output_router_logits:
            aux_loss, z_loss_logits = self.router_losses(outputs, attention_mask)
            if aux_loss is not None and labels is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
                if self.config.router_z_loss_coef > 0:
                    z_loss = router_z_loss_func(z_loss_logits)
                    loss = loss + self.config.router_z_loss_coef * z_loss.to(loss.device)
        return self.causal_lm_output(outputs, loss=loss, aux_loss=aux_loss, logits=logits)

    def router_losses(
        self, outputs: MoeModelOutputWithPast, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """(unweighted load-balancing loss, router logits the z-loss runs over) of a backbone's outputs."""
        if not outputs.router_logits:
            return None, ()
        aux_loss = load_balancing_loss_func(
            outputs.router_logits, self.config.num_experts, self.config.num_experts_per_tok, attention_mask
        )
        return aux_loss, outputs.router_logits

    def causal_lm_output(self, outputs: MoeModelOutputWithPast, **fields) -> MoeCausalLMOutputWithPast:
        return MoeCausalLMOutputWithPast(
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            **fields,
        )


__all__ = [
    "LlamaMoEForCausalLM",
    "LlamaMoEModel",
    "LlamaMoEPreTrainedModel",
    "LlamaMoERouter",
    "LlamaMoEExperts",
    "LlamaMoESparseMoeBlock",
]

"""LlamaMoE: LLaMA with Mixture-of-Experts feed-forward blocks (LLaMA-MoE v1/v2, sparse upcycling, G-MoEfication).

Attention, norms and rotary embeddings are transformers' own modules of the dense source family
(`config.source_model_type`: LLaMA, Mistral, Qwen2, Qwen3, Phi-3), used as they are; only the MoE parts are new:

    routers   one class per gate type (`config.router_type`): `routers.py`, shared with AttnMoE's attention experts
    experts   LlamaMoEExperts: fused weights; `forward` is the plain reference loop (`experts_implementation="eager"`);
              the other implementations (`llama_moe_auto`, the default, and `llama_moe_cpu`, `llama_moe_cpu_compiled`,
              transformers' `grouped_mm`, `batched_mm`) are in `moe_kernels.py`
    block     LlamaMoESparseMoeBlock: router + experts (+ shared experts, + G-MoEfication compensation)
    layer     LlamaMoEDecoderLayer: LLaMA decoder layer whose MLP is dense or MoE (`config.moe_layers`)
    model     LlamaMoEModel
    heads     LlamaMoEForCausalLM, LlamaMoEForSequenceClassification, LlamaMoEForTokenClassification,
              LlamaMoEForQuestionAnswering

The causal-LM head adds `router_aux_loss_coef * aux_loss` (the Switch load-balancing loss of `router_logits`) to
`loss`, and the other router losses as `router_losses.py` describes.

This file is copied next to saved checkpoints (remote code) with the files it imports relatively; it imports only
transformers, torch and those files.
"""

import functools
import importlib

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.import_utils import is_torchdynamo_compiling
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .cache_compat import CACHE_ARG, accepts_past_key_values, output_cache
from .configuration_llama_moe import LlamaMoEConfig
from .moe_kernels import (
    FusedExperts,
    compiled_shared_experts,
    expert_one_hot,
    padded_experts_forward,
)
from .router_losses import attach_router_loss, collect_router_losses, router_loss_share, router_losses
from .routers import ROUTER_CLASSES, LlamaMoERouter
from .save_hooks import SaveWithHooksMixin


@functools.cache
def source_modules(model_type: str) -> tuple[type, type, type]:
    """(attention, RMS norm, rotary embedding) classes of transformers' dense family `model_type`, by its naming
    convention (`Qwen3Model` -> `Qwen3Attention`, `Qwen3RMSNorm`, `Qwen3RotaryEmbedding`): the MoE keeps its source's
    attention exactly, and follows transformers' own changes to it."""
    prefix = MODEL_MAPPING_NAMES.get(model_type, "").removesuffix("Model")
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        return tuple(getattr(module, prefix + part) for part in ("Attention", "RMSNorm", "RotaryEmbedding"))
    except (ImportError, AttributeError):
        raise ValueError(
            f"source_model_type {model_type!r}: the installed transformers has no attention, RMS norm and rotary "
            "embedding modules of that name."
        ) from None


@use_experts_implementation
class LlamaMoEExperts(FusedExperts):
    """Routed experts as fused 3-D tensors: `gate_up_proj [E, 2m, H]` (gate rows first), `down_proj [E, H, m]`."""

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        top_k_index: torch.Tensor,  # [T, k]
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:
        """Plain reference (`experts_implementation="eager"`): each expert runs on the tokens routed to it."""
        output = torch.zeros_like(hidden_states)
        for expert_idx in range(self.num_experts):
            token_idx, slot = torch.where(top_k_index == expert_idx)  # [n] each
            if token_idx.numel():
                expert_output = self.expert(hidden_states[token_idx], expert_idx)
                output.index_add_(0, token_idx, expert_output * top_k_weights[token_idx, slot, None].to(output.dtype))
        return output

    def expert_choice(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        token_index: torch.Tensor,  # [E, C]: the tokens each expert chose
        weights: torch.Tensor,  # [E, C]
    ) -> torch.Tensor:
        """Expert-choice routing: every expert adds its weighted output to the tokens it chose. With
        `experts_implementation="eager"` the plain loop (reference); otherwise all experts at once, with fixed shapes
        and no host sync (`padded_experts_forward`: the chosen tokens are its padded rows)."""
        if self.config._experts_implementation == "eager":
            return self.expert_choice_reference(hidden_states, token_index, weights)
        row_weight = weights.reshape(-1, 1).to(hidden_states.dtype)
        return padded_experts_forward(self, hidden_states, token_index.reshape(-1), row_weight)

    def expert_choice_reference(self, hidden_states, token_index, weights) -> torch.Tensor:
        """`expert_choice` as a plain loop over the experts."""
        output = torch.zeros_like(hidden_states)
        for expert_idx in range(self.num_experts):
            tokens = token_index[expert_idx]  # [C]
            expert_output = self.expert(hidden_states[tokens], expert_idx)
            output.index_add_(0, tokens, expert_output * weights[expert_idx, :, None].to(output.dtype))
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
        self.config = config  # whose experts implementation may compile these too (`llama_moe_cpu_compiled`)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [T, H]
        output = compiled_shared_experts(self, hidden_states)
        if output is None:
            output = self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))
        return output


class LlamaMoESparseMoeBlock(nn.Module):
    """output = score_scale_factor * sum_{e in top-k} w_e * expert_e(x)  [+ shared_experts(x)]
    [+ sum_{e not in top-k} compensation_e  (G-MoEfication, `config.moe_compensation`)]

    Under expert-choice routing in training, the experts of a token are those that chose it (0 to E of them)."""

    def __init__(self, config: LlamaMoEConfig, layer_idx: int):
        super().__init__()
        self.score_scale_factor = config.layer_score_scale(layer_idx)
        self.z_loss_weight = config.router_z_loss_coef / config.num_router_layers
        self.mi_loss_weight = config.router_mi_loss_coef / config.num_router_layers
        self.gate = ROUTER_CLASSES[config.router_type](config)
        self.experts = LlamaMoEExperts(config)
        self.shared_experts = LlamaMoESharedExperts(config) if config.num_shared_experts > 0 else None
        # G-MoEfication representative values: row e stands in for expert e's output when it is not selected.
        self.compensation = (
            nn.Parameter(torch.zeros(config.num_experts, config.hidden_size)) if config.moe_compensation else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        flat_states = hidden_states.view(-1, hidden_dim)  # [T, H]
        # weights, index: [T, k], each token's experts; [E, C], each expert's tokens, when the router chooses tokens
        router_logits, weights, index = self.gate(flat_states)
        chooses_tokens = self.gate.chooses_tokens
        if self.score_scale_factor != 1.0:
            weights = weights * self.score_scale_factor
        if chooses_tokens:
            output = self.experts.expert_choice(flat_states, index, weights)
        else:
            output = self.experts(flat_states, index, weights)
        if self.compensation is not None:
            output = output + self.compensation_output(index, flat_states.shape[0], chooses_tokens).to(output.dtype)
        if self.shared_experts is not None:
            output = output + self.shared_experts(flat_states)
        if self.z_loss_weight or self.mi_loss_weight:
            loss = router_losses(router_logits, self.z_loss_weight, self.mi_loss_weight)
            output = attach_router_loss(self, output, loss)
        return output.view(batch_size, sequence_length, hidden_dim)

    def compensation_output(self, index: torch.Tensor, num_tokens: int, chooses_tokens: bool) -> torch.Tensor:
        """`[T, H]`: the sum of the compensation rows of each token's unselected experts (0 when all are selected)."""
        if chooses_tokens:  # index [E, C]: expert e took the tokens index[e]
            unselected = self.compensation.new_ones(num_tokens, self.compensation.shape[0])  # [T, E] 0/1 mask
            unselected.scatter_(0, index.t(), 0.0)
        else:  # index [T, k]
            unselected = (~expert_one_hot(index, self.compensation.shape[0]).any(1)).to(self.compensation.dtype)
        return unselected @ self.compensation


class LlamaMoEDecoderLayer(GradientCheckpointingLayer):
    moe_block_class = LlamaMoESparseMoeBlock  # the MLP of `config.moe_layers` (a family may swap in its own)

    def __init__(self, config: LlamaMoEConfig, layer_idx: int):
        super().__init__()
        attention_class, norm_class, _ = source_modules(config.source_model_type)
        self.hidden_size = config.hidden_size
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = attention_class(config=config, layer_idx=layer_idx)
        self.mlp = self.moe_block_class(config, layer_idx) if layer_idx in config.moe_layers else LlamaMLP(config)
        self.input_layernorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)

    @accepts_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        hidden_states = self.attention_residual(
            hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, **kwargs
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    def attention_residual(
        self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, **kwargs
    ) -> torch.Tensor:
        """`h + self_attn(input_layernorm(h))`: the layer's first half (a family with its own MLP call reuses it)."""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # hidden_states positionally: a module called with keyword arguments only fires its full backward hooks
        # before its own backward (DeepSpeed reduces a ZeRO-3 leaf's gradients in one: AttnMoE's attention).
        hidden_states, _ = self.self_attn(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **{CACHE_ARG: cache},
            **kwargs,
        )
        return residual + hidden_states


class LlamaMoEPreTrainedModel(SaveWithHooksMixin, PreTrainedModel):
    config: LlamaMoEConfig
    config_class = LlamaMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaMoEDecoderLayer"]
    _skip_keys_device_placement = [CACHE_ARG]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True  # compiled, the default experts run without host syncs (llama_moe_auto)
    _supports_attention_backend = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(LlamaMoERouter, index=0),
        "hidden_states": LlamaMoEDecoderLayer,
        "attentions": "self_attn",  # by module name: the attention class is the source family's
    }

    # Auto class -> head class of this family (in this file): registered with transformers' Auto classes, and
    # written into `auto_map` on save so that every head loads from a saved folder as remote code.
    auto_heads = {
        "AutoModel": "LlamaMoEModel",
        "AutoModelForCausalLM": "LlamaMoEForCausalLM",
        "AutoModelForSequenceClassification": "LlamaMoEForSequenceClassification",
        "AutoModelForTokenClassification": "LlamaMoEForTokenClassification",
        "AutoModelForQuestionAnswering": "LlamaMoEForQuestionAnswering",
    }

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers decides by searching the class's module source for `@use_experts_implementation`; AttnMoE's
        # file has no experts class of its own (its MLP experts are these), so every family here says yes.
        return True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # transformers would default to grouped_mm everywhere; `llama_moe_auto` keeps it off CPU only.
        return super().get_correct_experts_implementation(requested_experts or "llama_moe_auto")

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, FusedExperts):  # SoapMoE's experts too
            nn.init.normal_(module.gate_up_proj, mean=0.0, std=std)
            nn.init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, LlamaMoERouter):
            module.init_weights(std)
        elif isinstance(module, LlamaMoESparseMoeBlock) and module.compensation is not None:
            nn.init.zeros_(module.compensation)


class LlamaMoEModel(LlamaMoEPreTrainedModel):
    decoder_layer_class = LlamaMoEDecoderLayer  # AttnMoE and SoapMoE swap in their own layers and reuse the rest
    output_class = MoeModelOutputWithPast

    def __init__(self, config: LlamaMoEConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [self.decoder_layer_class(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        _, norm_class, rotary_class = source_modules(config.source_model_type)
        self.norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_class(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    @accepts_past_key_values
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        masks = self.attention_masks(inputs_embeds, attention_mask, position_ids, cache)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=masks[decoder_layer.attention_type],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=use_cache,
                **{CACHE_ARG: cache},
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return self.output_class(last_hidden_state=hidden_states, **{CACHE_ARG: cache})

    def attention_masks(self, inputs_embeds, attention_mask, position_ids, cache) -> dict:
        """The mask of each layer type of `config.layer_types` (sliding windows as the source family has them);
        `generate` may have made them already."""
        if isinstance(attention_mask, dict):
            return attention_mask
        mask_kwargs = {
            "config": self.config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            CACHE_ARG: cache,
        }
        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: make[kind](**mask_kwargs) for kind in set(self.config.layer_types)}


class LlamaMoEForCausalLM(LlamaMoEPreTrainedModel, GenerationMixin):
    backbone_class = LlamaMoEModel
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: LlamaMoEConfig):
        super().__init__(config)
        self.model = self.backbone_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    @accepts_past_key_values
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        r"""
        `aux_loss` is the (unweighted) Switch load-balancing loss of `router_logits`, as in Mixtral; with `labels`,
        `loss = lm_loss + router_aux_loss_coef * aux_loss + the other router losses` (z-loss, MI loss, attention
        balance loss; in training, weighted by `router_loss_share`). Without `labels`, and under `torch.compile`, those
        are attached to the graph in training instead (`router_losses.py`): their gradients flow, unweighted,
        and `loss` leaves them out.
        """
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        collect = labels is not None and not is_torchdynamo_compiling()  # compiled, the losses stay attached
        backbone = functools.partial(
            self.model,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        # Compiled, no with-block around the backbone: Dynamo failed to resume after a graph break inside one (SoapMoE)
        outputs, router_loss_terms = collect_router_losses(backbone) if collect else (backbone(), [])
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            if router_loss_terms:
                share = router_loss_share(labels, **kwargs)
                loss = loss + share * sum(term.to(loss.device) for term in router_loss_terms)
        aux_loss = self.router_aux_loss(outputs, attention_mask) if output_router_logits else None
        if aux_loss is not None and labels is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return self.causal_lm_output(outputs, attention_mask, loss=loss, aux_loss=aux_loss, logits=logits)

    def router_aux_loss(self, outputs: MoeModelOutputWithPast, attention_mask) -> torch.Tensor | None:
        """The Switch load-balancing loss of `router_logits` (unweighted), as in Mixtral."""
        if not outputs.router_logits:
            return None
        return load_balancing_loss_func(
            outputs.router_logits, self.config.num_experts, self.config.num_experts_per_tok, attention_mask
        )

    def causal_lm_output(self, outputs: MoeModelOutputWithPast, attention_mask, **fields) -> MoeCausalLMOutputWithPast:
        return MoeCausalLMOutputWithPast(
            **{CACHE_ARG: output_cache(outputs)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            **fields,
        )


class LlamaMoEForSequenceClassification(GenericForSequenceClassification, LlamaMoEPreTrainedModel):
    backbone_class = LlamaMoEModel

    def __init__(self, config: LlamaMoEConfig):
        # The generic head builds its backbone with AutoModel.from_config, which a checkpoint loaded as remote code
        # cannot resolve; build the same modules (same keys) directly.
        LlamaMoEPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = self.backbone_class(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class LlamaMoEForTokenClassification(GenericForTokenClassification, LlamaMoEPreTrainedModel):
    backbone_class = LlamaMoEModel

    def __init__(self, config: LlamaMoEConfig):
        LlamaMoEPreTrainedModel.__init__(self, config)  # see LlamaMoEForSequenceClassification
        self.num_labels = config.num_labels
        self.model = self.backbone_class(config)
        dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=True)
        self.post_init()


class LlamaMoEForQuestionAnswering(GenericForQuestionAnswering, LlamaMoEPreTrainedModel):
    """Extractive question answering (start and end logits per token), like `MixtralForQuestionAnswering`."""

    backbone_class = LlamaMoEModel

    def __init__(self, config: LlamaMoEConfig):
        LlamaMoEPreTrainedModel.__init__(self, config)  # see LlamaMoEForSequenceClassification
        self.model = self.backbone_class(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


__all__ = [
    "CACHE_ARG",
    "ROUTER_CLASSES",
    "LlamaMoEExperts",
    "LlamaMoEForCausalLM",
    "LlamaMoEForQuestionAnswering",
    "LlamaMoEForSequenceClassification",
    "LlamaMoEForTokenClassification",
    "LlamaMoEModel",
    "LlamaMoEPreTrainedModel",
    "LlamaMoERouter",
    "LlamaMoESparseMoeBlock",
]

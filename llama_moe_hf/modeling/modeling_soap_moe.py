"""SoapMoE: LLaMA with SOAP blocks: experts soft-merged in parameter space, once per segment of tokens.

In a SOAP layer the E experts (each the dense FFN's shape) are averaged with routing weights (SMEAR-style merging)
and the merged FFN runs as one ordinary SwiGLU FFN on every token of the segment:

    w_j      = softmax(gate(mean of the layer input over segment j-1))        segment 0: its own mean, no gradient
    FFN_j    = SwiGLU with gate_up = sum_e w_j[e] * gate_up_proj[e], down = sum_e w_j[e] * down_proj[e]
    output_t = score_scale_factor * FFN_j(x_t)  [+ shared_experts(x_t)]      for every token t of segment j

Merging costs about E/S of the FFN's work (E experts, S = `segment_length` tokens). Because segment j is routed by
segment j-1, a token's output never depends on later segments; within segment 0 the routing sees the whole segment
(SOAP's choice), with its weights cut from the gradient.

    router    SoapMoERouter: segment representation [.., H] -> (logits [.., E], weights [.., E], top-k weights and ids)
    experts   SoapMoEExperts: fused `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`; `forward` is the fast chunked
              path (`SegmentMergedFFN`: merged weights of a chunk of segments at a time, re-merged in backward),
              `reference_forward` the plain one (merge everything, then two batched matmuls; autograd does the rest)
    block     SoapMoEBlock: segments, padding-aware segment means, routing, generation state
    layer     SoapMoEDecoderLayer: LLaMA decoder layer whose MLP is dense or SOAP (`config.moe_layers`)
    model     SoapMoEModel, SoapMoEForCausalLM (and the classification and question-answering heads)

Generation uses the standard KV cache; each SOAP layer keeps its routing state next to it (`SoapRoutingState`).
`config.routing_mode = "prompt"` routes once on the prompt and decodes with that merged FFN; `"segment"` re-routes
every `segment_length` tokens, as in training.

This file is copied next to saved checkpoints (remote code): it imports only transformers, torch and the other
files of this folder.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder

from .cache_compat import accepts_past_key_values
from .configuration_soap_moe import SoapMoEConfig
from .modeling_llama_moe import (
    LlamaMoEDecoderLayer,
    LlamaMoEForCausalLM,
    LlamaMoEForQuestionAnswering,
    LlamaMoEForSequenceClassification,
    LlamaMoEForTokenClassification,
    LlamaMoEModel,
    LlamaMoEPreTrainedModel,
    LlamaMoESharedExperts,
)
from .moe_kernels import FusedExperts, swiglu_bmm, swiglu_linear
from .soap_kernels import SegmentMergedFFN, merge_experts


@dataclass
class SoapMoEModelOutputWithPast(MoeModelOutputWithPast):
    r"""
    router_logits (`tuple(torch.Tensor)`): with `output_router_logits=True`, per SOAP layer `[B, segments, E]`.
    routing_weights (`tuple(torch.Tensor)`): with `output_routing_weights=True`, per SOAP layer the merge weights
        `[B, segments, E]` (zero for experts outside the top-k when `num_experts_per_tok` is set).
    """

    routing_weights: tuple[torch.Tensor, ...] | None = None


@dataclass
class SoapMoECausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""
    routing_weights (`tuple(torch.Tensor)`): see `SoapMoEModelOutputWithPast`.
    expert_utilization (`torch.Tensor`): with `output_routing_weights=True`, per SOAP layer the share of experts
        whose routing weight reaches `config.utilization_threshold`, averaged over segments `[layers]`.
    """

    routing_weights: tuple[torch.Tensor, ...] | None = None
    expert_utilization: torch.Tensor | None = None


def expert_utilization(routing_weights: tuple[torch.Tensor, ...], threshold: float) -> torch.Tensor:
    """Per layer, the share of experts with routing weight >= `threshold`, averaged over segments. [layers]"""
    return torch.stack([(weights >= threshold).float().mean() for weights in routing_weights])


class SoapMoERouter(nn.Module):
    """Linear gate `weight [E, H]`, softmax over the experts in float32; with top-k merging only the k largest
    weights, renormalised to sum to 1. When all experts merge, the top-k ids are `0..E-1` in order."""

    def __init__(self, config: SoapMoEConfig):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.merge_top_k
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(states.float(), self.weight.float())  # [.., E]
        weights = logits.softmax(dim=-1)
        if self.top_k == self.num_experts:
            index = torch.arange(self.num_experts, device=logits.device).expand_as(weights)
            return logits, weights, weights, index
        top_weights, index = weights.topk(self.top_k, dim=-1)  # [.., k]
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return logits, torch.zeros_like(weights).scatter(-1, index, top_weights), top_weights, index


class SoapMoEExperts(FusedExperts):
    """E experts of one SOAP layer as fused 3-D tensors: `gate_up_proj [E, 2I, H]` (gate rows first), `down_proj
    [E, H, I]` (LlamaMoE's layout and names)."""

    def __init__(self, config: SoapMoEConfig):
        super().__init__(config)
        self.chunk = config.merge_chunk_size
        self.silu = config.hidden_act in ("silu", "swish")  # the fast path's hand-written activation backward

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Fast path: x [N, L, H] (N segments), weights and index [N, k] -> [N, L, H]."""
        experts = (self.gate_up_proj, self.down_proj)
        return SegmentMergedFFN.apply(x, weights, index, *experts, self.act_fn, self.chunk, self.silu)

    def reference_forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Plain path (same result): merge every segment's experts, then the FFN as two batched matmuls."""
        return self.apply_merged(x, self.merge(weights, index))

    def merge(self, weights: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged FFN of each row: ([N, 2I, H], [N, H, I])."""
        return merge_experts(weights, index, self.gate_up_proj), merge_experts(weights, index, self.down_proj)

    def apply_merged(self, x: torch.Tensor, merged: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [N, L, H] through row n's merged FFN. One row runs as the dense FFN's two linear layers."""
        gate_up, down = merged
        if x.shape[0] == 1:
            return swiglu_linear(x[0], gate_up[0], down[0], self.act_fn).unsqueeze(0)
        return swiglu_bmm(x, gate_up, down, self.act_fn)


@dataclass
class SoapRoutingState:
    """One SOAP layer's routing during generation, kept with the KV cache: the current segment's routing input
    [B, H], the sum and count of its layer inputs so far ([B, H], [B]), and its merged FFN (reused until the next
    segment, or for the whole generation with prompt routing)."""

    route_input: torch.Tensor | None = None
    input_sum: torch.Tensor | None = None
    input_count: torch.Tensor | None = None
    merged: tuple[torch.Tensor, torch.Tensor] | None = None

    def reorder(self, beam_idx: torch.LongTensor) -> None:
        """Follow the rows of the cache (beam search)."""
        for name in ("route_input", "input_sum", "input_count"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, beam_idx))
        if self.merged is not None:
            self.merged = tuple(t.index_select(0, beam_idx.to(t.device)) for t in self.merged)


@dataclass
class SoapRoutingContext:
    """What every SOAP layer needs to know about the forward, worked out once for all layers (on the host, so the
    layers never wait on the device): the padding mask of its tokens [B, T] (None: no padding), how many tokens the
    cache already holds, how many of them are real tokens in each row (an int when every row has as many, else one
    per row: a left-padded row counts its segments from its first real token), the real tokens of each row in this
    forward (None: all of them), and the per-layer generation states (None: no cache)."""

    padding_mask: torch.Tensor | None
    past_length: int
    states: dict[int, SoapRoutingState] | None = field(default=None)
    seen: int | tuple[int, ...] | None = None  # None: `past_length`
    real: tuple[int, ...] | None = None
    packed: "PackedSequences | None" = None  # padding-free input: several sequences in a row

    def __post_init__(self):
        if self.seen is None:
            self.seen = self.past_length

    @property
    def uniform(self) -> bool:
        """Every row's tokens sit on the same segment slots (no padding, the same real tokens cached)."""
        return self.padding_mask is None and isinstance(self.seen, int)


@dataclass
class PackedSequences:
    """Sequences packed into rows without padding, told apart by their position ids restarting (what TRL's
    `padding_free` and transformers' packed attention use): each token's sequence and place in it [B*T], the
    sequences' lengths (host), and their padding mask as rows [N, L] (float32)."""

    sequence: torch.Tensor
    position: torch.Tensor
    lengths: tuple[int, ...]
    mask: torch.Tensor

    @classmethod
    def find(cls, position_ids: torch.Tensor) -> "PackedSequences | None":
        """The sequences in `position_ids` [B, T] (a new one wherever the position does not follow the previous
        one), or None when each row is one sequence."""
        batch, length = position_ids.shape
        starts = position_ids[:, 1:] != position_ids[:, :-1] + 1  # [B, T-1]
        if not bool(starts.any()):  # one host sync
            return None
        begins = torch.cat([starts.new_ones(batch, 1), starts], 1).reshape(-1)  # [B*T]: every row begins one
        sequence = begins.long().cumsum(0) - 1
        first = begins.nonzero().squeeze(-1)  # [N]
        position = torch.arange(batch * length, device=position_ids.device) - first[sequence]
        lengths = torch.diff(first, append=first.new_tensor([batch * length])).tolist()
        places = torch.arange(max(lengths), device=position_ids.device)
        mask = (places[None] < torch.tensor(lengths, device=position_ids.device)[:, None]).float()
        return cls(sequence, position, tuple(lengths), mask)


def segment_layout(x: torch.Tensor, mask: torch.Tensor, offset: int, segment_length: int):
    """x [B, T, H] and mask [B, T] placed on whole segments: `offset` empty slots first (the part of the first
    segment already in the cache), zeros to the end. -> x [B, n, S, H], mask [B, n, S]."""
    batch, length, hidden = x.shape
    n = -(-(offset + length) // segment_length)
    tail = n * segment_length - offset - length
    x = F.pad(x, (0, 0, offset, tail)).view(batch, n, segment_length, hidden)
    return x, F.pad(mask, (offset, tail)).view(batch, n, segment_length)


def row_segment_layout(x: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor, n: int, segment_length: int):
    """`segment_layout` row by row, for padded rows: each row's real tokens packed on n segments from its own offset
    [B] (padding skipped, so left padding does not move the borders). -> x [B, n, S, H], mask [B, n, S], and each
    token's slot among the n * S [B, T] (padding: the spare slot n * S)."""
    batch, length, hidden = x.shape
    real = mask > 0
    slot = offsets[:, None] + real.long().cumsum(1) - 1  # [B, T]: slot of each real token
    slot = torch.where(real, slot, n * segment_length)
    placed = x.new_zeros(batch, n * segment_length + 1, hidden).scatter(1, slot[..., None].expand_as(x), x)
    placed_mask = mask.new_zeros(batch, n * segment_length + 1).scatter(1, slot, mask)
    layout = placed[:, :-1].view(batch, n, segment_length, hidden)
    return layout, placed_mask[:, :-1].view(batch, n, segment_length), slot


class SoapMoEBlock(nn.Module):
    """A SOAP layer: route each segment, merge its experts, run the merged FFN (module docstring)."""

    def __init__(self, config: SoapMoEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.segment_length = layer_idx, config.segment_length
        self.routing_mode = config.routing_mode
        self.score_scale_factor = config.layer_score_scale(layer_idx)
        self.gate = SoapMoERouter(config)
        self.experts = SoapMoEExperts(config)
        self.shared_experts = LlamaMoESharedExperts(config) if config.num_shared_experts > 0 else None

    def forward(self, hidden_states: torch.Tensor, context: SoapRoutingContext | None = None) -> torch.Tensor:
        context = context or SoapRoutingContext(padding_mask=None, past_length=0)
        if context.packed is not None:
            output = self._packed_routed(hidden_states, context.packed)
        else:
            output = self._routed(hidden_states, context)
        if self.score_scale_factor != 1.0:
            output = output * self.score_scale_factor
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output

    def _packed_routed(self, x: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
        """Padding-free input: each packed sequence routed as a row of its own, its segments counted from its first
        token (as if it came alone), then put back in place."""
        hidden = x.shape[-1]
        rows = x.new_zeros(len(packed.lengths), packed.mask.shape[1], hidden)  # [N, L, H]
        rows[packed.sequence, packed.position] = x.reshape(-1, hidden)
        context = SoapRoutingContext(packed.mask, 0, real=packed.lengths)
        output = self._segment_routed(rows, packed.mask, context, None)
        return output[packed.sequence, packed.position].view_as(x)

    def _routed(self, hidden_states: torch.Tensor, context: SoapRoutingContext) -> torch.Tensor:
        state = None
        if context.states is not None:
            if context.past_length == 0:  # a new sequence: forget the previous one's routing
                context.states[self.layer_idx] = SoapRoutingState()
            state = context.states.setdefault(self.layer_idx, SoapRoutingState())
        mask = context.padding_mask  # float32: counts stay exact past 256 tokens (bfloat16 would round them)
        if mask is None:
            mask = hidden_states.new_ones(hidden_states.shape[:2], dtype=torch.float32)
        mask = mask.to(hidden_states.device, torch.float32)
        if state is not None and self.routing_mode == "prompt":
            return self._prompt_routed(hidden_states, mask, state)
        return self._segment_routed(hidden_states, mask, context, state)

    def _prompt_routed(self, x: torch.Tensor, mask: torch.Tensor, state: SoapRoutingState) -> torch.Tensor:
        """Route once on the mean of the prompt (the first forward of the sequence); reuse that merged FFN."""
        if state.merged is None:
            prompt_mean = (x.float() * mask[..., None]).sum(1) / mask.sum(1).clamp(min=1)[:, None]  # [B, H]
            _, _, top_weights, top_index = self.gate(prompt_mean)
            state.merged = self.experts.merge(top_weights, top_index)
        return self.experts.apply_merged(x, state.merged)

    def _segment_routed(self, x, mask, context: SoapRoutingContext, state: SoapRoutingState | None) -> torch.Tensor:
        batch, length, hidden = x.shape
        past_length, size = context.past_length, self.segment_length
        seen = (context.seen,) * batch if isinstance(context.seen, int) else context.seen
        real = context.real or (length,) * batch
        offsets = [count % size for count in seen]  # per row, tokens of its first segment already seen (host)
        if state is not None and min(offsets) > 0 and length == 1 and state.merged is not None:  # inside a segment
            self._accumulate(state, x.float() * mask[..., None], mask)
            return self.experts.apply_merged(x, state.merged)
        n = max(1, max(-(-(o + r) // size) for o, r in zip(offsets, real)))
        last = [max(o + r - 1, 0) // size for o, r in zip(offsets, real)]  # each row's last segment here
        if context.uniform:
            segments, segment_mask = segment_layout(x, mask, offsets[0], size)  # [B, n, S, H], [B, n, S]
            slots = None
        else:
            row_offsets = torch.tensor(offsets, device=x.device)
            segments, segment_mask, slots = row_segment_layout(x, mask, row_offsets, n, size)
        sums = (segments.float() * segment_mask[..., None]).sum(2)  # [B, n, H]
        counts = segment_mask.sum(2)  # [B, n], float32
        continuing = torch.tensor(offsets, device=x.device)[:, None] > 0  # [B, 1]: first segment began in the cache
        if past_length and (state is None or state.input_sum is None):
            raise ValueError("A SoapMoE forward after cached tokens needs the cache that holds their routing state.")
        if past_length:
            sums[:, 0] += state.input_sum * continuing
            counts[:, 0] += state.input_count * continuing[:, 0]
        means = sums / counts.clamp(min=1)[..., None]
        route_inputs = torch.cat([self._first_route_input(means, past_length, continuing, state), means[:, :-1]], 1)
        _, _, top_weights, top_index = self.gate(route_inputs)  # [B, n, k] each
        if past_length == 0:  # segment 0 routes on itself: its weights get no gradient
            top_weights = torch.cat([top_weights[:, :1].detach(), top_weights[:, 1:]], dim=1)
        k = top_index.shape[-1]
        if state is not None and n == 1:  # generation inside one segment: merge once, run the tokens as they are
            merged = self.experts.merge(top_weights[:, 0], top_index[:, 0])
            self._keep(state, route_inputs[:, 0], sums[:, 0], counts[:, 0], merged)
            return self.experts.apply_merged(x, merged)
        output = self.experts(
            segments.reshape(batch * n, size, hidden),
            top_weights.reshape(batch * n, k),
            top_index.reshape(batch * n, k),
        ).view(batch, n * size, hidden)
        if state is not None:
            rows, last = torch.arange(batch, device=x.device), torch.tensor(last, device=x.device)
            with torch.no_grad():
                merged = self.experts.merge(top_weights[rows, last], top_index[rows, last])
            self._keep(state, route_inputs[rows, last], sums[rows, last], counts[rows, last], merged)
        if slots is None:
            return output[:, offsets[0] : offsets[0] + length]
        output = torch.cat([output, output.new_zeros(batch, 1, hidden)], 1)  # padding reads the spare slot: zeros
        return output.gather(1, slots[..., None].expand(-1, -1, hidden))

    @staticmethod
    def _first_route_input(means, past_length: int, continuing, state: SoapRoutingState | None) -> torch.Tensor:
        """Routing input of the first segment of this forward: [B, 1, H]."""
        if past_length == 0:
            return means[:, :1]  # segment 0: its own mean
        finished = state.input_sum / state.input_count.clamp(min=1)[:, None]  # the segment just finished
        return torch.where(continuing, state.route_input, finished)[:, None]  # continuing: route as it was routed

    @staticmethod
    def _keep(state: SoapRoutingState, route_input, input_sum, input_count, merged) -> None:
        """Remember the last segment of this forward for the next one (generation)."""
        state.route_input, state.input_sum, state.input_count = route_input, input_sum, input_count
        state.merged = tuple(t.detach() for t in merged)

    @staticmethod
    def _accumulate(state: SoapRoutingState, masked_x: torch.Tensor, mask: torch.Tensor) -> None:
        state.input_sum = state.input_sum + masked_x.sum(1)
        state.input_count = state.input_count + mask.sum(1)


class SoapMoEDecoderLayer(LlamaMoEDecoderLayer):
    """LLaMA decoder layer whose MLP is dense or a SOAP block (`config.moe_layers`)."""

    moe_block_class = SoapMoEBlock

    @accepts_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        routing_context: SoapRoutingContext | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """LlamaMoE's layer; a SOAP block also takes the forward's `routing_context` (`SoapMoEModel.forward`)."""
        hidden_states = self.attention_residual(
            hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, **kwargs
        )
        states = self.post_attention_layernorm(hidden_states)
        mlp = self.mlp(states, routing_context) if isinstance(self.mlp, SoapMoEBlock) else self.mlp(states)
        return hidden_states + mlp


class SoapMoEPreTrainedModel(LlamaMoEPreTrainedModel):
    config: SoapMoEConfig
    config_class = SoapMoEConfig
    _no_split_modules = ["SoapMoEDecoderLayer"]
    _can_compile_fullgraph = False  # routing state lives outside the graph
    _can_record_outputs = {
        "router_logits": OutputRecorder(SoapMoERouter, index=0),
        "routing_weights": OutputRecorder(SoapMoERouter, index=1),
        "hidden_states": SoapMoEDecoderLayer,
        "attentions": "self_attn",
    }
    auto_heads = {
        "AutoModel": "SoapMoEModel",
        "AutoModelForCausalLM": "SoapMoEForCausalLM",
        "AutoModelForSequenceClassification": "SoapMoEForSequenceClassification",
        "AutoModelForTokenClassification": "SoapMoEForTokenClassification",
        "AutoModelForQuestionAnswering": "SoapMoEForQuestionAnswering",
    }

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # SOAP merges its experts' weights once per segment and runs one FFN: there is no per-token expert kernel
        # (eager / grouped_mm / batched_mm) to choose, so the switch is not offered.
        return False

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)  # the experts' too (FusedExperts)
        if isinstance(module, SoapMoERouter):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)


class SoapMoEModel(SoapMoEPreTrainedModel, LlamaMoEModel):
    """LlamaMoE's backbone (its forward is reused) built from SOAP decoder layers."""

    decoder_layer_class = SoapMoEDecoderLayer
    output_class = SoapMoEModelOutputWithPast

    @merge_with_config_defaults
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
    ) -> SoapMoEModelOutputWithPast:
        """LlamaMoE's forward, with what the SOAP blocks need to know about the whole forward (segments, padding,
        the routing state kept with the cache) handed to each layer as `routing_context`."""
        if inputs_embeds is None and input_ids is not None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:  # made here: the routing state lives with it
            cache = DynamicCache(config=self.config)
        return super().forward(
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cache=cache,
            routing_context=self.routing_context(attention_mask, cache, inputs_embeds, position_ids),
            **kwargs,
        )

    def routing_context(self, attention_mask, cache, inputs_embeds, position_ids) -> SoapRoutingContext:
        """`position_ids` as the caller gave them (None: consecutive)."""
        length = inputs_embeds.shape[1]
        past = 0 if cache is None else int(cache.get_seq_length())
        padding_mask, seen, real = None, past, None
        # Padding-free input, told apart as transformers' attention masks do it (no mask, no cache)
        if position_ids is not None and cache is None and length > 1 and attention_mask is None:
            packed = PackedSequences.find(position_ids.expand(inputs_embeds.shape[0], -1))
            if packed is not None:
                return SoapRoutingContext(None, 0, packed=packed)
        # `generate` with a static cache passes the masks it made (a 4D mask, or one per layer type): no padding info
        two_d = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
        if two_d and not bool(attention_mask.all()):
            padding_mask = attention_mask[:, -length:]
            counts = torch.stack([padding_mask.sum(1), attention_mask[:, :-length].sum(1)]).long().tolist()  # one sync
            real = tuple(counts[0])
            if past and attention_mask.shape[1] == past + length:  # real tokens cached per row
                seen = counts[1][0] if len(set(counts[1])) == 1 else tuple(counts[1])
        if cache is None or self.training:  # training routes by segments whatever `routing_mode` says, no state
            return SoapRoutingContext(padding_mask, past, seen=seen, real=real)
        if not hasattr(cache, "soap_routing"):
            cache.soap_routing = {}
        return SoapRoutingContext(padding_mask, past, cache.soap_routing, seen=seen, real=real)


class SoapMoEForCausalLM(SoapMoEPreTrainedModel, LlamaMoEForCausalLM, GenerationMixin):
    """SoapMoE with a language-modelling head. `output_routing_weights=True` returns each layer's routing weights
    and the expert utilisation; SOAP has no load-balancing loss (every expert is merged, none is dropped)."""

    backbone_class = SoapMoEModel

    def router_aux_loss(self, outputs, attention_mask) -> None:
        return None

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """Never compiled by `generate`: with a static cache on a GPU it compiles the forward whatever
        `_can_compile_fullgraph` says (transformers 5.23 to 5.24), and SoapMoE's routing breaks the graph at its host
        syncs. `torch.compile(model)` by hand runs (docs/soap.md, "What the code does")."""
        return False

    def create_masks_for_generate(self, attention_mask=None, **_):
        """`generate` turns the 2D mask into 4D masks up front for a fixed-size (static) cache, which only a compiled
        forward needs; the SOAP blocks read the padding from the 2D mask (padded tokens stay out of the segment
        means), and this model is never compiled by `generate`: the 2D mask goes to the forward as it is."""
        return attention_mask

    def _reorder_cache(self, cache, beam_idx: torch.LongTensor):
        """Beam search: the SOAP layers' routing states follow the KV cache's rows."""
        cache.reorder_cache(beam_idx)
        for state in getattr(cache, "soap_routing", {}).values():
            state.reorder(beam_idx)
        return cache

    def causal_lm_output(self, outputs, attention_mask, **fields) -> SoapMoECausalLMOutputWithPast:
        weights = outputs.routing_weights
        utilization = expert_utilization(weights, self.config.utilization_threshold) if weights else None
        return SoapMoECausalLMOutputWithPast(
            **super().causal_lm_output(outputs, attention_mask, **fields),
            routing_weights=weights,
            expert_utilization=utilization,
        )


class SoapMoEForSequenceClassification(SoapMoEPreTrainedModel, LlamaMoEForSequenceClassification):
    backbone_class = SoapMoEModel


class SoapMoEForTokenClassification(SoapMoEPreTrainedModel, LlamaMoEForTokenClassification):
    backbone_class = SoapMoEModel


class SoapMoEForQuestionAnswering(SoapMoEPreTrainedModel, LlamaMoEForQuestionAnswering):
    backbone_class = SoapMoEModel


__all__ = [
    "SoapMoEBlock",
    "SoapMoEExperts",
    "SoapMoEForCausalLM",
    "SoapMoEForQuestionAnswering",
    "SoapMoEForSequenceClassification",
    "SoapMoEForTokenClassification",
    "SoapMoEModel",
    "SoapMoEPreTrainedModel",
    "SoapMoERouter",
    "expert_utilization",
]

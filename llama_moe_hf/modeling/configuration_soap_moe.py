"""SoapMoE configuration: a LLaMA config plus the fields of SOAP's soft-merged, segment-routed experts.

This file is copied next to saved checkpoints (remote code), so it only imports from transformers,
huggingface_hub and `.configuration_llama_moe`.
"""

from huggingface_hub.dataclasses import strict

from .configuration_llama_moe import LlamaLikeConfig, LlamaMoEConfig

ROUTING_MODES = ("segment", "prompt")


@strict
class SoapMoEConfig(LlamaLikeConfig):
    r"""
    Configuration of a LLaMA-like model whose feed-forward blocks are SOAP blocks: `num_experts` FFNs of the dense
    FFN's shape, merged in parameter space with routing weights once per segment of `segment_length` tokens, then
    run as one ordinary FFN. Every field of [`LlamaLikeConfig`] (LLaMA's and the source family's) keeps its
    meaning; fields shared with `LlamaMoEConfig` keep its names and meaning. The SOAP fields are:

        num_experts (`int`, defaults to 8): experts per MoE layer.
        num_experts_per_tok (`int`, *optional*): top-k merging: merge only the k highest-weighted experts of each
            segment, renormalised to sum to 1 (less merge work). Default: merge all experts.
        moe_intermediate_size (`int`, *optional*): intermediate size of one expert. Defaults to `intermediate_size`
            (every expert has the dense FFN's shape).
        num_shared_experts (`int`, defaults to 0): always-on FFNs added to the merged FFN's output, stored fused as
            one MLP of `num_shared_experts * shared_expert_intermediate_size`.
        shared_expert_intermediate_size (`int`, *optional*): defaults to `moe_intermediate_size`.
        score_scale_factor (`float` or `list[float]`, defaults to 1.0): scale of the merged FFN's output; one value
            or one per decoder layer.
        segment_length (`int`, defaults to 256): tokens per routing segment. Segment j is routed by the mean MoE-layer
            input of segment j-1; segment 0 by its own mean, with a stop-gradient on its routing weights.
        routing_mode (`str`, defaults to `"segment"`): how generation (a forward with a KV cache) routes:
            - `"segment"`: as in training; the merged FFN is re-merged every `segment_length` tokens.
            - `"prompt"`: route once on the mean of the whole prompt and generate with that merged FFN (as fast as
              the dense model).
            Training, and any forward without a cache, route by segments; in eval mode a forward with a cache (the
            default `use_cache`) is a prefill and routes by this mode.
        utilization_threshold (`float`, defaults to 0.05): an expert counts as used in a segment when its routing
            weight is at least this (the `expert_utilization` statistic).
        merge_chunk_size (`int`, defaults to 16): segments merged at once; the merged weights of one chunk,
            `merge_chunk_size * 3 * moe_intermediate_size * hidden_size` values, bound the extra memory.
        output_router_logits (`bool`, defaults to False): return each layer's router logits, routing weights and
            expert utilisation.
        moe_layers (`list[int]`, *optional*): decoder layers that are SOAP layers; the others keep a dense LLaMA
            MLP. Defaults to every layer.
        conversion_info (`dict`, *optional*): how the checkpoint was made; informational.
    """

    model_type = "soap_moe"
    # Experts are merged, not dispatched: no expert parallelism, and the merged FFN runs on the full expert tensors
    # (so they stay replicated); attention shards by the source family's rules (`LlamaLikeConfig`).
    base_model_tp_plan = {}
    base_model_pp_plan = LlamaMoEConfig.base_model_pp_plan

    num_experts: int = 8
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    score_scale_factor: float | int | list[float] = 1.0
    segment_length: int = 256
    routing_mode: str = "segment"
    utilization_threshold: float = 0.05
    merge_chunk_size: int = 16
    output_router_logits: bool = False
    moe_layers: list[int] | None = None
    conversion_info: dict | None = None

    def __post_init__(self, **kwargs):
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.shared_expert_intermediate_size is None:
            self.shared_expert_intermediate_size = self.moe_intermediate_size
        if self.moe_layers is None:
            self.moe_layers = list(range(self.num_hidden_layers))
        if isinstance(self.score_scale_factor, int):
            self.score_scale_factor = float(self.score_scale_factor)
        super().__post_init__(**kwargs)
        self.validate_moe()  # plain ValueErrors (the strict validator wraps them)

    def validate_architecture(self):
        """Part of `@strict` validation."""
        super().validate_architecture()
        self.validate_moe()

    def validate_moe(self):
        """One clear `ValueError` per impossible SOAP setting."""
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {self.num_experts}.")
        if self.num_experts_per_tok is not None and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok (top-k merging) must be between 1 and num_experts={self.num_experts} "
                f"or unset (merge all), got {self.num_experts_per_tok}."
            )
        for name in ("segment_length", "merge_chunk_size", "moe_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}.")
        if self.routing_mode not in ROUTING_MODES:
            raise ValueError(f"Unknown routing_mode {self.routing_mode!r}; choose one of {', '.join(ROUTING_MODES)}.")
        if not 0.0 <= self.utilization_threshold <= 1.0:
            raise ValueError(f"utilization_threshold must be in [0, 1], got {self.utilization_threshold}.")
        if isinstance(self.score_scale_factor, list) and len(self.score_scale_factor) != self.num_hidden_layers:
            raise ValueError(
                f"score_scale_factor has {len(self.score_scale_factor)} values but the model has "
                f"{self.num_hidden_layers} layers; give one float or one value per layer."
            )
        bad_layers = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers or len(set(self.moe_layers)) != len(self.moe_layers):
            raise ValueError(
                f"moe_layers must be distinct layers in 0..{self.num_hidden_layers - 1}: {self.moe_layers}."
            )

    @property
    def merge_top_k(self) -> int:
        """Experts merged per segment."""
        return self.num_experts_per_tok or self.num_experts

    layer_score_scale = LlamaMoEConfig.layer_score_scale


__all__ = ["SoapMoEConfig"]

"""AttnMoE configuration: LLaMA-MoE v2 attention-head experts, optionally combined with an MLP MoE.

This file is copied next to saved checkpoints (remote code), so it only imports from transformers, huggingface_hub
and `.configuration_llama_moe`.
"""

from huggingface_hub.dataclasses import strict

from .configuration_llama_moe import LlamaMoEConfig

ATTENTION_EXPERT_GRANULARITIES = ("kv_group", "query_heads")
ATTENTION_EXPERTS_IMPLEMENTATIONS = ("masked", "gathered")


def valid_attention_expert_counts(num_heads: int, num_kv_heads: int, granularity: str) -> list[int]:
    """Expert counts that cut `num_heads` query heads into equal, in-order experts without splitting a KV head."""
    group_size = num_heads // num_kv_heads  # query heads sharing one K/V head
    if granularity == "kv_group":  # an expert is one or more whole KV groups
        return [e for e in range(1, num_kv_heads + 1) if num_kv_heads % e == 0]
    # an expert is a subset of the query heads of a single KV group
    return [num_kv_heads * s for s in range(1, group_size + 1) if group_size % s == 0]


@strict
class AttnMoEConfig(LlamaMoEConfig):
    r"""
    Configuration of a LLaMA model whose attention heads are Mixture-of-Experts (LLaMA-MoE v2 attention MoE), with a
    dense MLP or with LlamaMoE's MLP MoE.

    The query heads are cut, in order, into `num_attention_experts` experts of `num_attention_heads //
    num_attention_experts` heads; a router per layer picks `num_attention_experts_per_tok` of them for every token.
    K/V are computed for every token and every KV head, so the KV cache is the standard one (see docs/attn_moe.md).

    Every field of [`LlamaMoEConfig`] keeps its meaning for the MLP side. The attention fields are:

        num_attention_experts (`int`, *optional*): attention experts per layer. Defaults to `num_key_value_heads`
            (one expert per KV group).
        num_attention_experts_per_tok (`int`, *optional*): attention experts each token uses (top-k). Defaults to
            half the experts (at least 1).
        attention_expert_granularity (`str`, *optional*): what one expert is, under grouped-query attention:
            - `"kv_group"`: one or more whole KV groups (all query heads that share those K/V heads);
              `num_attention_experts` must divide `num_key_value_heads`.
            - `"query_heads"`: a subset of the query heads of one KV group; `num_attention_experts` must be a
              multiple of `num_key_value_heads` that divides `num_attention_heads`.
            Defaults to `"kv_group"` when `num_attention_experts <= num_key_value_heads`, else `"query_heads"` (the
            two coincide when the counts are equal).
        attention_score_scale_factor (`float` or `list[float]`, defaults to 1.0): rescaling of the attention expert
            outputs (like `score_scale_factor`); one value or one per decoder layer.
        attention_router_type (`str`, *optional*): router of the attention experts, one of LlamaMoE's token-choice
            router types (not `"expert_choice"`). Defaults to `router_type` (`"top_k"` when that is
            `"expert_choice"`).
        attention_moe_layers (`list[int]`, *optional*): decoder layers with attention MoE; the others keep dense
            attention. Defaults to every layer.
        attention_experts_implementation (`str`, defaults to `"masked"`): how the routed heads are computed; both
            give the same output.
            - `"masked"`: every head is computed, then weighted by its expert's routing weight (0 if unselected)
              before `o_proj`. Saves no compute; works with every attention kernel, PEFT/LoRA wrappers and training.
            - `"gathered"`: `q_proj`, the attention scores and `o_proj` run only for the selected (token, expert)
              pairs (one sdpa call per expert and sequence). Needs plain `nn.Linear` projections and the sdpa or
              eager attention; otherwise the layer falls back to `"masked"`.

    The MLP side: `moe_layers` defaults to `[]` here (dense MLP everywhere). With no MLP MoE layer, `num_experts`
    and `num_experts_per_tok` are set to the attention values, because they are what the load-balancing loss (and
    TRL's SFTTrainer) read for the routers in `router_logits`. `router_aux_loss_coef`, `router_z_loss_coef`,
    `router_mi_loss_coef` and `output_router_logits` apply to the attention routers too.
    """

    model_type = "attn_moe"

    num_attention_experts: int | None = None
    num_attention_experts_per_tok: int | None = None
    attention_expert_granularity: str | None = None
    attention_score_scale_factor: float | int | list[float] = 1.0
    attention_router_type: str | None = None
    attention_moe_layers: list[int] | None = None
    attention_experts_implementation: str = "masked"

    def __post_init__(self, **kwargs):
        if self.num_attention_experts is None:
            self.num_attention_experts = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_experts_per_tok is None:
            self.num_attention_experts_per_tok = max(1, self.num_attention_experts // 2)
        if self.attention_expert_granularity is None:
            num_kv_heads = self.num_key_value_heads or self.num_attention_heads
            self.attention_expert_granularity = (
                "kv_group" if self.num_attention_experts <= num_kv_heads else "query_heads"
            )
        if self.attention_router_type is None:
            self.attention_router_type = "top_k" if self.router_type == "expert_choice" else self.router_type
        if self.attention_moe_layers is None:
            self.attention_moe_layers = list(range(self.num_hidden_layers))
        if isinstance(self.attention_score_scale_factor, int):
            self.attention_score_scale_factor = float(self.attention_score_scale_factor)
        if self.moe_layers is None:
            self.moe_layers = []
        if not self.moe_layers:
            # No MLP router: the MoE fields describe the attention routers (they are the ones in `router_logits`).
            self.num_experts = self.num_attention_experts
            self.num_experts_per_tok = self.num_attention_experts_per_tok
        # Checked first (the MoE fields may mirror these) and here, not only in the strict validator, which wraps
        # errors, so users get one plain ValueError about the attention setting.
        self.validate_attention_moe()
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict` validation."""
        self.validate_attention_moe()
        super().validate_architecture()

    def validate_attention_moe(self):
        """One clear `ValueError` per impossible attention-MoE setting."""
        if self.source_model_type != "llama" and self.attention_moe_layers:
            raise ValueError(
                f"Attention experts are LLaMA attention heads; a {self.source_model_type!r} model's attention differs "
                "(biases, q/k norms, fused projections or windows) and cannot become AttnMoE experts."
            )
        self.check_attention_experts_split()
        num_experts, top_k = self.num_attention_experts, self.num_attention_experts_per_tok
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_attention_experts_per_tok (attention top-k) must be between 1 and "
                f"num_attention_experts={num_experts}, got {top_k}."
            )
        if self.attention_experts_implementation not in ATTENTION_EXPERTS_IMPLEMENTATIONS:
            raise ValueError(
                f"Unknown attention_experts_implementation {self.attention_experts_implementation!r}; choose one of "
                f"{', '.join(ATTENTION_EXPERTS_IMPLEMENTATIONS)}."
            )
        self._check_attention_router()
        scale = self.attention_score_scale_factor
        if isinstance(scale, list) and len(scale) != self.num_hidden_layers:
            raise ValueError(
                f"attention_score_scale_factor has {len(scale)} values but the model has {self.num_hidden_layers} "
                "layers; give one float or one value per layer."
            )
        layers = self.attention_moe_layers
        bad_layers = [i for i in layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers:
            raise ValueError(f"attention_moe_layers {bad_layers} are outside 0..{self.num_hidden_layers - 1}.")
        if len(set(layers)) != len(layers):
            raise ValueError(f"attention_moe_layers has duplicates: {layers}.")

    def _check_attention_router(self):
        from .routers import ROUTER_CLASSES

        # Expert choice gives a token 0..E experts from the whole batch; the attention experts only route token choice.
        token_choice = [name for name, cls in ROUTER_CLASSES.items() if cls.token_choice]
        kind = self.attention_router_type
        if kind in ROUTER_CLASSES and kind not in token_choice:
            raise ValueError(
                f"attention_router_type={kind!r} is not supported: attention experts are routed token-choice only; "
                f"choose one of {', '.join(token_choice)}."
            )
        if kind not in token_choice:
            raise ValueError(f"Unknown attention_router_type {kind!r}; choose one of {', '.join(token_choice)}.")

    def check_attention_experts_split(self):
        """The query heads must split into `num_attention_experts` experts as `attention_expert_granularity` says:
        whole KV groups, or equal subsets of each group's query heads."""
        num_heads, num_kv_heads = self.num_attention_heads, self.num_key_value_heads or self.num_attention_heads
        num_experts = self.num_attention_experts
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}."
            )
        granularity = self.attention_expert_granularity
        if granularity not in ATTENTION_EXPERT_GRANULARITIES:
            raise ValueError(
                f"Unknown attention_expert_granularity {granularity!r}; choose one of "
                f"{', '.join(ATTENTION_EXPERT_GRANULARITIES)}."
            )
        valid = valid_attention_expert_counts(num_heads, num_kv_heads, granularity)
        if num_experts not in valid:
            what = (
                f"the {num_kv_heads} KV groups into equal whole groups"
                if granularity == "kv_group"
                else f"each KV group's {num_heads // num_kv_heads} query heads into equal subsets"
            )
            raise ValueError(
                f"Cannot cut {num_heads} query heads / {num_kv_heads} KV heads into {num_experts} attention experts "
                f"with attention_expert_granularity={granularity!r}: experts must split {what} (an expert may not "
                f"split a KV head's group across experts). Valid counts: {valid}."
            )

    @property
    def num_router_layers(self) -> int:
        """Router modules in the model (MLP and attention): the per-router z-loss is averaged over them."""
        return max(1, len(self.moe_layers) + len(self.attention_moe_layers))

    @property
    def heads_per_attention_expert(self) -> int:
        return self.num_attention_heads // self.num_attention_experts

    def layer_attention_score_scale(self, layer_idx: int) -> float:
        """The attention expert output scale of decoder layer `layer_idx`."""
        if isinstance(self.attention_score_scale_factor, list):
            return float(self.attention_score_scale_factor[layer_idx])
        return float(self.attention_score_scale_factor)


__all__ = ["AttnMoEConfig"]

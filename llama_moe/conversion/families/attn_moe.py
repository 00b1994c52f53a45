"""AttnMoE: attention heads as experts (LLaMA-MoE v2), optionally with an MLP MoE (`model_type: attn_moe`)."""

import dataclasses

from ...source_families import SOURCE_FAMILIES, dense_config_fields
from ..registry import FAMILIES, ROUTER_INITS, option
from ..settings import ATTENTION_GRANULARITIES, MLP_PART, Part
from ..target import ATTENTION, MLP
from .base import ModelFamily, layers_text, mlp_card_rows, mlp_config_fields, mlp_info_line


@dataclasses.dataclass(frozen=True)
class AttnMoEOptions:
    attn_experts: int | None = option(None, "attention experts per layer (default: one per KV head)")
    attn_top_k: int | None = option(None, "attention experts per token (default: half of them)")
    attn_granularity: str | None = option(
        None,
        "an expert is whole KV groups or query heads of one group (default: kv_group if experts <= KV heads)",
        choices=ATTENTION_GRANULARITIES,
    )
    attn_score_scale_factor: float | None = option(None, "attention expert output scale (default: the top-k)")
    attn_router_type: str | None = option(None, "gate of the attention routers (default: top_k)")
    attn_router_init: str | None = option(
        None,
        "attention routers: zero, random, or fit on calibration text (default: --router-init if it applies, "
        "else random)",
    )
    attn_method: str = option("attention_heads", "how the attention heads become experts")
    attn_layers: list[str] | None = option(None, "decoder layers with attention experts (default: all)")
    mlp_moe: bool = option(False, "also turn the MLPs into an MoE (the MLP options apply)")


ATTENTION_PART = Part(
    ATTENTION,
    method="attn_method",
    router_init="attn_router_init",
    router_type="attn_router_type",
    num_experts="attn_experts",
    top_k="attn_top_k",
    num_shared_experts=None,
    score_scale_factor="attn_score_scale_factor",
    layers="attn_layers",
)


@FAMILIES.register("attn_moe")
class AttnMoEFamily(ModelFamily):
    description = "LLaMA with attention heads as experts (LLaMA-MoE v2), with a dense MLP or an MLP MoE"
    Options = AttnMoEOptions
    parts = {ATTENTION: ATTENTION_PART, MLP: MLP_PART}

    def target_kinds(self, recipe) -> list[str]:
        return [ATTENTION, MLP] if recipe.options.get("mlp_moe") else [ATTENTION]

    def check(self, recipe) -> None:
        if recipe.options.get("mlp_moe"):
            return
        defaults = type(recipe)()
        changed = [f for f in MLP_PART.fields().values() if getattr(recipe, f) != getattr(defaults, f)] + [
            "compensation"
        ] * (recipe.compensation != defaults.compensation)
        if changed:
            flags = ", ".join("--" + name.replace("_", "-") for name in changed)
            raise ValueError(f"{flags} shape an MLP MoE; add --mlp-moe to convert the MLPs as well as the attention.")

    def resolve(self, recipe):
        options = dict(recipe.options)
        if options.get("attn_router_init") is None:  # the MLP's init if it can start attention routers
            inherit = recipe.router_init in ROUTER_INITS and ATTENTION in ROUTER_INITS[recipe.router_init].targets
            options["attn_router_init"] = recipe.router_init if inherit else "random"
        return dataclasses.replace(recipe, options=options)

    def resolve_for_model(self, recipe, dense_config):
        if not SOURCE_FAMILIES[dense_config.model_type].llama_attention:
            raise ValueError(
                f"The attn_moe family turns LLaMA attention heads into experts; a {dense_config.model_type!r} "
                "model's attention differs (biases, q/k norms, fused projections or windows). Use llama_moe or "
                "soap_moe for it."
            )
        options = dict(recipe.options)
        if options.get("attn_experts") is None:
            options["attn_experts"] = dense_config.num_key_value_heads or dense_config.num_attention_heads
        if options.get("attn_top_k") is None:
            options["attn_top_k"] = max(1, options["attn_experts"] // 2)
        return dataclasses.replace(recipe, options=options)

    def build_config(self, dense_config, recipe, plan):
        attention = plan.targets[ATTENTION]
        fields = mlp_config_fields(recipe, plan) if MLP in plan.targets else {"moe_layers": []}
        return self.config_class()(
            **dense_config_fields(dense_config),
            **fields,
            num_attention_experts=attention.num_experts,
            num_attention_experts_per_tok=attention.top_k,
            attention_expert_granularity=recipe.options["attn_granularity"],
            attention_score_scale_factor=attention.score_scale_factor,
            attention_router_type=attention.router_type,
            attention_moe_layers=list(attention.layers),
        )

    def card_rows(self, config, plan):
        method, router = plan.components[ATTENTION]
        experts = (
            f"{config.num_attention_experts} ({config.heads_per_attention_expert} query head(s) each, granularity "
            f"`{config.attention_expert_granularity}`; {config.num_attention_heads} query / "
            f"{config.num_key_value_heads} KV heads)"
        )
        rows = [
            ("Attention method", f"`{method.name}`: {method.description}"),
            ("Attention experts per layer", experts),
            ("Attention experts per token (top-k)", config.num_attention_experts_per_tok),
            ("Attention MoE layers", layers_text(config.attention_moe_layers, config.num_hidden_layers)),
            (
                "Attention router",
                f"`{config.attention_router_type}`, initialised `{router.name}`: {router.description}",
            ),
            ("Attention score scale factor", config.attention_score_scale_factor),
            ("What a token attends to", "all earlier tokens (K/V for every token, standard KV cache)"),
        ]
        return rows + (mlp_card_rows(config, plan) if config.moe_layers else [("MLP", "dense (not converted)")])

    @staticmethod
    def info_lines(config) -> list[str]:
        attention = (
            f"attention experts: {config.num_attention_experts} ({config.attention_expert_granularity}, "
            f"top-{config.num_attention_experts_per_tok}), attention MoE layers {config.attention_moe_layers}"
        )
        return [attention] + ([mlp_info_line(config)] if config.moe_layers else [])

    @staticmethod
    def active_parameters(config, name: str, numel: int) -> int:
        """q_proj and o_proj of attention-MoE layers count k/E (the heads a token uses); the rest as LlamaMoE."""
        parts = name.split(".")
        routed = (
            len(parts) > 4
            and parts[3] == "self_attn"
            and parts[4] in ("q_proj", "o_proj")
            and not (parts[4] == "o_proj" and parts[-1] == "bias")
            and int(parts[2]) in config.attention_moe_layers
        )
        if routed:
            return numel * config.num_attention_experts_per_tok // config.num_attention_experts
        return ModelFamily.active_parameters(config, name, numel)

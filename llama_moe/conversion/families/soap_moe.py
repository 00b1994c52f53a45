"""SoapMoE: SOAP's soft-merged experts with causal segment routing (`model_type: soap_moe`)."""

import dataclasses

from ...source_families import dense_config_fields
from ..registry import FAMILIES, option
from ..settings import ROUTING_MODES, Part
from ..target import MLP
from .base import ModelFamily, layers_text

# Recipe fields of the LlamaMoE MLP that SOAP does not use, with what to set instead.
_NOT_FOR_SOAP = {
    "method": "--soap-method",
    "top_k": "--merge-top-k",
    "router_type": None,
    "num_shared_experts": None,
    "compensation": None,
}


@dataclasses.dataclass(frozen=True)
class SoapMoEOptions:
    segment_length: int = option(256, "tokens per routing segment; segment j is routed by segment j-1")
    routing_mode: str = option(
        "segment", "generation: re-route every segment, or route once on the prompt", choices=ROUTING_MODES
    )
    merge_top_k: int | None = option(None, "merge only the k highest-weighted experts per segment (default: all)")
    soap_method: str = option("upcycle", "how the experts start", choices=("upcycle",))


# The experts: the recipe's MLP settings with SOAP's method and merge top-k; no gate type, no shared experts
SOAP_PART = Part(MLP, method="soap_method", top_k="merge_top_k", router_type=None, num_shared_experts=None)


@FAMILIES.register("soap_moe")
class SoapMoEFamily(ModelFamily):
    description = "LLaMA with SOAP layers: experts soft-merged per segment, each segment routed by the previous one"
    heals = False  # a SOAP block routes whole segments and merges its experts: not what healing trains
    Options = SoapMoEOptions
    parts = {MLP: SOAP_PART}

    def check(self, recipe) -> None:
        defaults = type(recipe)()
        changed = [name for name in _NOT_FOR_SOAP if getattr(recipe, name) != getattr(defaults, name)]
        if changed:
            flags = ", ".join("--" + name.replace("_", "-") for name in changed)
            instead = [_NOT_FOR_SOAP[name] for name in changed if _NOT_FOR_SOAP[name]]
            hint = f" (SoapMoE uses {', '.join(instead)})" if instead else ""
            raise ValueError(f"{flags} do not apply to --family soap_moe{hint}.")

    def build_config(self, dense_config, recipe, plan):
        target = plan.targets[MLP]
        method, _ = plan.components[MLP]
        options = recipe.options
        return self.config_class()(
            **dense_config_fields(dense_config),
            num_experts=target.num_experts,
            num_experts_per_tok=target.top_k,
            score_scale_factor=1.0 if target.score_scale_factor is None else target.score_scale_factor,
            moe_layers=list(target.layers),
            segment_length=options["segment_length"],
            routing_mode=options["routing_mode"],
            moe_intermediate_size=method.expert_size(),
        )

    def card_rows(self, config, plan):
        method, router = plan.components[MLP]
        merged = config.num_experts_per_tok or "all"
        return [
            ("Method", f"`{method.name}`: {method.description}"),
            ("Experts per SOAP layer", f"{config.num_experts} (each {config.moe_intermediate_size} wide)"),
            ("Experts merged per segment", merged),
            ("Segment length (tokens)", config.segment_length),
            ("Generation routing", f"`{config.routing_mode}`"),
            ("SOAP layers", layers_text(config.moe_layers, config.num_hidden_layers)),
            ("Router", f"softmax over the experts, initialised `{router.name}`: {router.description}"),
            ("Score scale factor", config.score_scale_factor),
        ]

    @staticmethod
    def info_lines(config) -> list[str]:
        return [
            f"experts: {config.num_experts} soft-merged (merge {config.num_experts_per_tok or 'all'}), segments of "
            f"{config.segment_length} tokens, {config.routing_mode} routing in generation, "
            f"SOAP layers {config.moe_layers}"
        ]

    @staticmethod
    def active_parameters(config, name: str, numel: int) -> int:
        """Each token runs one merged FFN: the experts count as one expert's worth."""
        if ".mlp.experts." in name:
            return numel // config.num_experts
        return numel

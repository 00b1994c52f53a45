"""Base class of the model families: what a conversion builds, and how the card and `llama-moe info` describe it."""

import dataclasses

from ..registry import NoOptions
from ..settings import MLP_PART
from ..target import MLP


class ModelFamily:
    """An output model family, registered under its config's `model_type` with `@FAMILIES.register(model_type)`.

    It says which blocks of the decoder layers become experts (`parts`: where a recipe holds each block's settings),
    builds the output config, and describes a checkpoint in the model card and `llama-moe info`.
    """

    name = ""  # set by FAMILIES.register: the config's model_type
    description = ""
    Options = NoOptions
    parts = {MLP: MLP_PART}
    heals = True  # its MoE MLP blocks route tokens top-k, as `healing` trains them

    def target_kinds(self, recipe) -> list[str]:
        """The blocks that become experts, in layer order of conversion."""
        return list(self.parts)

    def resolve(self, recipe):
        """The family's own defaults that need no source model filled in."""
        return recipe

    def resolve_for_model(self, recipe, dense_config):
        """The family's own defaults that depend on the source model's config filled in, or one ValueError."""
        return recipe

    def check(self, recipe) -> None:
        """Family-specific refusals (one ValueError)."""

    def config_class(self):
        """The config class registered (`modeling.MODEL_FAMILIES`) under this family's model_type."""
        return self._modeling()[0]

    def model_class(self):
        """The family's causal-LM head (its `auto_heads["AutoModelForCausalLM"]`)."""
        _, base, module = self._modeling()
        return getattr(module, base.auto_heads["AutoModelForCausalLM"])

    def _modeling(self) -> tuple:
        from llama_moe_hf.modeling import MODEL_FAMILIES

        for config_class, (base, module) in MODEL_FAMILIES.items():
            if config_class.model_type == self.name:
                return config_class, base, module
        raise ValueError(f"No model classes are registered for family {self.name!r}.")

    def build_config(self, dense_config, recipe, plan) -> object:
        raise NotImplementedError

    def card_rows(self, config, plan) -> list[tuple[str, object]]:
        """The model card's settings table."""
        raise NotImplementedError

    @staticmethod
    def info_lines(config) -> list[str]:
        """What `llama-moe info` prints about the MoE settings, from the config alone."""
        return []

    @staticmethod
    def active_parameters(config, name: str, numel: int) -> int:
        """Parameters of tensor `name` used per token: routed experts count k/E of their size, the rest fully."""
        if ".mlp.experts." in name:
            return numel * config.num_experts_per_tok // config.num_experts
        return numel

    def default_options(self) -> dict:
        return {f.name: f.default for f in dataclasses.fields(self.Options)}


def layers_text(layers, num_layers: int) -> str:
    return f"all {num_layers}" if len(layers) == num_layers else f"{len(layers)} of {num_layers}: {list(layers)}"


def mlp_card_rows(config, plan) -> list[tuple[str, object]]:
    """The settings rows of an MLP MoE (LlamaMoE's, and AttnMoE's with an MLP MoE)."""
    method, router = plan.components[MLP]
    return [
        ("Method", f"`{method.name}`: {method.description}"),
        ("Routed experts per MoE layer", config.num_experts),
        ("Experts per token (top-k)", config.num_experts_per_tok),
        ("Shared (always-on) experts", config.num_shared_experts),
        ("Expert intermediate size", f"{config.moe_intermediate_size} (dense FFN: {config.intermediate_size})"),
        ("MoE layers", layers_text(config.moe_layers, config.num_hidden_layers)),
        ("Router", f"`{config.router_type}`, initialised `{router.name}`: {router.description}"),
        ("Score scale factor", config.score_scale_factor),
        ("G-MoEfication compensation (mean output of skipped experts)", "on" if config.moe_compensation else "off"),
    ]


def mlp_info_line(config) -> str:
    return (
        f"experts: {config.num_experts} routed "
        f"(top-{config.num_experts_per_tok}, size {config.moe_intermediate_size}), "
        f"{config.num_shared_experts} shared, router {config.router_type}, MoE layers {config.moe_layers}"
    )


def mlp_config_fields(recipe, plan) -> dict:
    """The LlamaMoE config fields of the MLP target (and its method's expert sizes)."""
    target = plan.targets[MLP]
    method, _ = plan.components[MLP]
    return {
        "num_experts": target.num_experts,
        "num_experts_per_tok": target.top_k,
        "num_shared_experts": target.num_shared_experts,
        "router_type": target.router_type,
        "score_scale_factor": target.score_scale_factor,
        "moe_layers": list(target.layers),
        "moe_compensation": recipe.compensation,
        **method.config_fields(),
    }

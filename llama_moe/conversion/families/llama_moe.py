"""LlamaMoE: LLaMA whose feed-forward blocks are Mixture-of-Experts blocks (`model_type: llama_moe`)."""

from ...source_families import dense_config_fields
from ..registry import FAMILIES
from .base import ModelFamily, mlp_card_rows, mlp_config_fields, mlp_info_line


@FAMILIES.register("llama_moe")
class LlamaMoEFamily(ModelFamily):
    description = "LLaMA with Mixture-of-Experts MLPs (LLaMA-MoE v1/v2, sparse upcycling, G-MoEfication)"

    def build_config(self, dense_config, recipe, plan):
        return self.config_class()(**dense_config_fields(dense_config), **mlp_config_fields(recipe, plan))

    def card_rows(self, config, plan):
        return mlp_card_rows(config, plan)

    @staticmethod
    def info_lines(config) -> list[str]:
        return [mlp_info_line(config)]

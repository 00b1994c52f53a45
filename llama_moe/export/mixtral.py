"""transformers' Mixtral (`MixtralForCausalLM`): softmax router, top-k renormalised to sum to 1, every layer MoE,
no shared experts.

LlamaMoE maps onto it exactly when its router renormalises the top-k at inference (`top_k`, and `noisy_top_k` and
`expert_choice`, which route that way outside training), every layer is MoE, there are no shared experts, and the
source's attention is LLaMA's or Mistral's (no biases; a sliding window in every layer or in none). The score scale
factor (one per layer, possibly) is folded into each expert's down projection. Written in Mixtral's
checkpoint layout (`block_sparse_moe.experts.{e}.w1/w2/w3`), which transformers, vLLM and llama.cpp's converter read.
"""

from .base import (
    TRANSFORMERS_NAMES,
    TransformersTarget,
    attention_reasons,
    dense_layers,
    keeps_weights_summing_to_one,
    uniform_window,
    window_reasons,
)
from .registry import TARGETS

MIXTRAL_NAMES = {
    **TRANSFORMERS_NAMES,
    "router": "model.layers.{bid}.block_sparse_moe.gate.weight",
    "gate_exps": "model.layers.{bid}.block_sparse_moe.experts.{e}.w1.weight",
    "down_exps": "model.layers.{bid}.block_sparse_moe.experts.{e}.w2.weight",
    "up_exps": "model.layers.{bid}.block_sparse_moe.experts.{e}.w3.weight",
}


def mixtral_layout_reasons(config) -> list[str]:
    """Why a Mixtral-style MoE layer (renormalised top-k, every layer MoE, no shared experts, attention without
    biases) cannot express the model."""
    reasons = []
    if not keeps_weights_summing_to_one(config):
        reasons.append(
            f"router_type {config.router_type!r} keeps the top-k softmax probabilities as they are, Mixtral "
            "renormalises them to sum to 1 (qwen2_moe has norm_topk_prob=False)"
        )
    if config.num_shared_experts:
        reasons.append(
            f"shared experts ({config.num_shared_experts}): a Mixtral layout has none (qwen2_moe has a shared expert)"
        )
    if dense_layers(config):
        reasons.append(
            f"the dense layers {dense_layers(config)}: every Mixtral layer is MoE (qwen2_moe has mlp_only_layers)"
        )
    if config.attention_bias:
        reasons.append("attention biases: Mixtral's attention has none")
    return reasons


@TARGETS.register("mixtral")
class Mixtral(TransformersTarget):
    description = (
        "transformers' MixtralForCausalLM: renormalised softmax top-k, every layer MoE, no shared experts; the score "
        "scale is folded into the experts' down projections."
    )
    names = MIXTRAL_NAMES

    @classmethod
    def target_reasons(cls, config) -> list[str]:
        attention = attention_reasons(config, "mixtral", ("llama", "mistral")) + window_reasons(config, "mixtral")
        return mixtral_layout_reasons(config) + attention

    def target_config(self):
        from transformers import MixtralConfig

        config = self.config
        return MixtralConfig(
            **self.shared_config_fields(),
            head_dim=config.head_dim,
            intermediate_size=config.moe_intermediate_size,  # Mixtral's experts are sized by intermediate_size
            num_local_experts=config.num_experts,
            sliding_window=uniform_window(config),
            router_jitter_noise=0.0,
            architectures=["MixtralForCausalLM"],
        )

"""transformers' Mixtral (`MixtralForCausalLM`): softmax router, top-k renormalised to sum to 1, every layer MoE,
no shared experts.

LlamaMoE maps onto it exactly when its router renormalises the top-k at inference (`top_k`, and `noisy_top_k` and
`expert_choice`, which route that way outside training), every layer is MoE and there are no shared experts. The
score scale factor (one per layer, possibly) is folded into each expert's down projection. Written in Mixtral's
checkpoint layout (`block_sparse_moe.experts.{e}.w1/w2/w3`), which transformers, vLLM and llama.cpp's converter read.
"""

from .base import TRANSFORMERS_NAMES, TransformersTarget, dense_layers
from .registry import TARGETS

MIXTRAL_NAMES = {
    **TRANSFORMERS_NAMES,
    "router": "model.layers.{bid}.block_sparse_moe.gate.weight",
    "gate_exps": "model.layers.{bid}.block_sparse_moe.experts.{e}.w1.weight",
    "down_exps": "model.layers.{bid}.block_sparse_moe.experts.{e}.w2.weight",
    "up_exps": "model.layers.{bid}.block_sparse_moe.experts.{e}.w3.weight",
}


def check_mixtral_layout(config) -> None:
    """Refuse what a Mixtral-style MoE (renormalised top-k, every layer MoE, no shared experts) cannot express."""
    if config.router_type == "switch":
        raise ValueError(
            "Cannot export router_type 'switch' to a Mixtral layout: switch keeps the top-k softmax probabilities as "
            "they are, Mixtral renormalises them to sum to 1 (qwen2_moe has norm_topk_prob=False)."
        )
    if config.num_shared_experts:
        raise ValueError(
            f"Cannot export shared experts ({config.num_shared_experts}) to a Mixtral layout, which has none "
            "(qwen2_moe has a shared expert)."
        )
    if dense_layers(config):
        raise ValueError(
            f"Cannot export the dense layers {dense_layers(config)} to a Mixtral layout, where every layer is MoE "
            "(qwen2_moe has mlp_only_layers)."
        )


@TARGETS.register("mixtral")
class Mixtral(TransformersTarget):
    description = (
        "transformers' MixtralForCausalLM: renormalised softmax top-k, every layer MoE, no shared experts; the score "
        "scale is folded into the experts' down projections."
    )
    names = MIXTRAL_NAMES

    def check(self):
        super().check()
        check_mixtral_layout(self.config)

    def target_config(self):
        from transformers import MixtralConfig

        config = self.config
        return MixtralConfig(
            **self.shared_config_fields(),
            head_dim=config.head_dim,
            intermediate_size=config.moe_intermediate_size,  # Mixtral's experts are sized by intermediate_size
            num_local_experts=config.num_experts,
            sliding_window=None,
            router_jitter_noise=0.0,
            architectures=["MixtralForCausalLM"],
        )

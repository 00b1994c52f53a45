"""transformers' Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k RMS norms, explicit head_dim, optional
biases), softmax top-k with or without renormalisation (`norm_topk_prob`), dense layers (`mlp_only_layers`), no
shared experts.

A LlamaMoE converted from a Qwen3 source maps onto it exactly: `top_k` (and `noisy_top_k` and `expert_choice`, which
route that way outside training) is `norm_topk_prob=True`, `switch` is `norm_topk_prob=False`; the attention tensors
are the source's, under the same names; the score scale factor is folded into each routed expert's down projection.
Qwen3-MoE has no shared expert, and a window in every layer or in none.

No stock family in transformers 5.23-5.24 takes Qwen3's attention with always-on shared experts exactly: Qwen3.5-MoE
and Qwen3-Next gate their attention output and centre their norms on 1 (`1 + weight`), HunYuan-MoE normalises queries
and keys after RoPE, and GLM-4-MoE, EXAONE-MoE and AFMoE score experts by a sigmoid, not a softmax.
"""

from .base import (
    TRANSFORMERS_NAMES,
    TransformersTarget,
    attention_reasons,
    dense_layers,
    router_class,
    uniform_window,
    window_reasons,
)
from .registry import TARGETS

QWEN3_MOE_NAMES = {
    **TRANSFORMERS_NAMES,
    "router": "model.layers.{bid}.mlp.gate.weight",
    "gate_exps": "model.layers.{bid}.mlp.experts.{e}.gate_proj.weight",
    "up_exps": "model.layers.{bid}.mlp.experts.{e}.up_proj.weight",
    "down_exps": "model.layers.{bid}.mlp.experts.{e}.down_proj.weight",
    "dense_gate": "model.layers.{bid}.mlp.gate_proj.weight",
    "dense_up": "model.layers.{bid}.mlp.up_proj.weight",
    "dense_down": "model.layers.{bid}.mlp.down_proj.weight",
}


@TARGETS.register("qwen3_moe")
class Qwen3Moe(TransformersTarget):
    description = (
        "transformers' Qwen3MoeForCausalLM, for Qwen3 sources: Qwen3's attention, softmax top-k with or without "
        "renormalisation, dense layers as mlp_only_layers, no shared experts."
    )
    names = QWEN3_MOE_NAMES

    @classmethod
    def target_reasons(cls, config) -> list[str]:
        reasons = attention_reasons(config, "qwen3_moe", ("qwen3",)) + window_reasons(config, "qwen3_moe")
        if config.num_shared_experts:
            reasons.append(f"shared experts ({config.num_shared_experts}): Qwen3-MoE has none")
        return reasons

    def target_config(self):
        from transformers import Qwen3MoeConfig

        config = self.config
        window = uniform_window(config)
        return Qwen3MoeConfig(
            **self.shared_config_fields(),
            head_dim=config.head_dim,
            attention_bias=config.attention_bias,
            intermediate_size=config.intermediate_size,  # the dense layers' MLP (mlp_only_layers)
            moe_intermediate_size=config.moe_intermediate_size,
            num_experts=config.num_experts,
            norm_topk_prob=router_class(config).renormalizes,
            mlp_only_layers=dense_layers(config),
            decoder_sparse_step=1,
            use_sliding_window=window is not None,
            sliding_window=window,
            architectures=["Qwen3MoeForCausalLM"],
        )

"""transformers' Qwen2-MoE (`Qwen2MoeForCausalLM`): softmax top-k with or without renormalisation
(`norm_topk_prob`), one shared expert behind a sigmoid gate, dense layers (`mlp_only_layers`), q/k/v biases.

LlamaMoE maps onto it exactly:

- router: `top_k` (and `noisy_top_k` and `expert_choice`, which route that way outside training) is
  `norm_topk_prob=True`; `switch` is `norm_topk_prob=False`.
- shared experts: LlamaMoE's always-on shared experts (stored fused, S neurons) are Qwen2-MoE's shared expert of
  size S. Its gate is `sigmoid(x @ w)`: with w = 0 it is exactly 1/2 for every token, so its down projection is
  doubled (both exact in floating point). A model without shared experts gets a one-neuron shared expert of zeros.
- dense layers (outside `moe_layers`) are `mlp_only_layers`, which Qwen2-MoE sizes by `intermediate_size`, the dense
  FFN's size in LlamaMoE too.
- attention: a Qwen2 source's q/k/v biases as they are; for LLaMA and Mistral sources (no biases) q/k/v biases of
  zeros (Qwen2-MoE checkpoints carry them, and vLLM and older transformers expect them); o_proj has no bias in any.
  Sliding windows per layer as the source has them (`layer_types`).
- the score scale factor (one per layer, possibly) is folded into each routed expert's down projection.

Qwen2-MoE derives the head size from hidden_size / num_attention_heads, so models with another head_dim are refused.
"""

from .base import TRANSFORMERS_NAMES, TransformersTarget, attention_reasons, dense_layers, router_class
from .registry import TARGETS

QWEN2_MOE_NAMES = {
    **TRANSFORMERS_NAMES,
    "router": "model.layers.{bid}.mlp.gate.weight",
    "gate_exps": "model.layers.{bid}.mlp.experts.{e}.gate_proj.weight",
    "up_exps": "model.layers.{bid}.mlp.experts.{e}.up_proj.weight",
    "down_exps": "model.layers.{bid}.mlp.experts.{e}.down_proj.weight",
    "shexp_gate": "model.layers.{bid}.mlp.shared_expert.gate_proj.weight",
    "shexp_up": "model.layers.{bid}.mlp.shared_expert.up_proj.weight",
    "shexp_down": "model.layers.{bid}.mlp.shared_expert.down_proj.weight",
    "dense_gate": "model.layers.{bid}.mlp.gate_proj.weight",
    "dense_up": "model.layers.{bid}.mlp.up_proj.weight",
    "dense_down": "model.layers.{bid}.mlp.down_proj.weight",
}
SHARED_EXPERT_GATE = "model.layers.{bid}.mlp.shared_expert_gate.weight"
ZERO_BIAS = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}


@TARGETS.register("qwen2_moe")
class Qwen2Moe(TransformersTarget):
    description = (
        "transformers' Qwen2MoeForCausalLM: softmax top-k with or without renormalisation, shared experts behind a "
        "constant 1/2 gate (down projection doubled), dense layers as mlp_only_layers, zero q/k/v biases."
    )
    names = QWEN2_MOE_NAMES

    @classmethod
    def target_reasons(cls, config) -> list[str]:
        reasons = attention_reasons(config, "qwen2_moe", ("llama", "mistral", "qwen2"))
        if config.head_dim != config.hidden_size // config.num_attention_heads:
            reasons.append(
                f"head_dim={config.head_dim}: Qwen2-MoE's head size is hidden_size / num_attention_heads = "
                f"{config.hidden_size // config.num_attention_heads}"
            )
        if config.attention_bias and config.source_model_type != "qwen2":
            reasons.append("an o_proj bias (attention_bias): Qwen2-MoE's o_proj has none")
        return reasons

    @property
    def zero_biases(self) -> bool:
        """Write q/k/v biases of zeros: the source has none (a Qwen2 source's are in the checkpoint)."""
        return self.config.source_model_type != "qwen2"

    def shared_size(self) -> int:
        """Neurons of the shared expert: all shared experts fused, or one (of zeros) when there are none."""
        return self.config.num_shared_experts * self.config.shared_expert_intermediate_size or 1

    def role_tensors(self, role, layer, tensor):
        if role == "shexp_down":
            tensor = tensor * 2  # the gate gives exactly 1/2
        yield from super().role_tensors(role, layer, tensor)
        if role in ZERO_BIAS and self.zero_biases:
            yield f"model.layers.{layer}.self_attn.{ZERO_BIAS[role]}.bias", tensor.new_zeros(tensor.shape[0])
        if role == "router":
            hidden = tensor.shape[1]
            yield SHARED_EXPERT_GATE.format(bid=layer), tensor.new_zeros(1, hidden)  # sigmoid(0) = 1/2
            if not self.config.num_shared_experts:  # a shared expert of zeros adds exactly 0
                yield from super().role_tensors("shexp_gate", layer, tensor.new_zeros(1, hidden))
                yield from super().role_tensors("shexp_up", layer, tensor.new_zeros(1, hidden))
                yield from super().role_tensors("shexp_down", layer, tensor.new_zeros(hidden, 1))

    def target_config(self):
        from transformers import Qwen2MoeConfig

        config = self.config
        return Qwen2MoeConfig(
            **self.shared_config_fields(),
            intermediate_size=config.intermediate_size,  # the dense layers' MLP (mlp_only_layers)
            moe_intermediate_size=config.moe_intermediate_size,
            shared_expert_intermediate_size=self.shared_size(),
            num_experts=config.num_experts,
            norm_topk_prob=router_class(config).renormalizes,
            mlp_only_layers=dense_layers(config),
            decoder_sparse_step=1,
            use_sliding_window="sliding_attention" in config.layer_types,
            sliding_window=config.sliding_window,
            layer_types=config.layer_types,
            qkv_bias=True,
            architectures=["Qwen2MoeForCausalLM"],
        )

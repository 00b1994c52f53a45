"""LlamaMoE configuration: a LLaMA config plus the Mixture-of-Experts fields.

This file is copied next to saved checkpoints (remote code), so it only imports from transformers, huggingface_hub and
packaging (a dependency of transformers).
"""

import transformers
from huggingface_hub.dataclasses import strict
from packaging.specifiers import SpecifierSet
from transformers import CONFIG_MAPPING, LlamaConfig

# This code's version (llama-moe-hf's) and the transformers releases it runs on. A saved folder's copy carries both:
# `llama-moe info` tells a folder whose copy is older than the installed package's (`llama-moe upgrade` replaces it),
# and the copy refuses, in one line, a transformers outside the range instead of generating garbage. setup.py reads
# both from here; CI tests the lowest and the newest release of the range (TRANSFORMERS_TESTED).
LLAMA_MOE_VERSION = "0.4.1"
TRANSFORMERS_REQUIREMENT = ">=5.23,<6"
TRANSFORMERS_TESTED = ("5.23.0", "5.24.0")

if transformers.__version__ not in SpecifierSet(TRANSFORMERS_REQUIREMENT, prereleases=True):
    raise ImportError(
        f"This model's code (llama-moe-hf {LLAMA_MOE_VERSION}) needs transformers{TRANSFORMERS_REQUIREMENT}, "
        f"found {transformers.__version__}: pip install 'transformers{TRANSFORMERS_REQUIREMENT}'"
    )

DEFAULT_ROUTER_TYPE = "top_k"  # softmax top-k, renormalised: what the stock MoE families compute


@strict
class LlamaLikeConfig(LlamaConfig):
    r"""
    A LLaMA config whose attention, norms and rotary embedding are those of a Llama-like dense family. Every field of
    [`LlamaConfig`] keeps its meaning; the fields of the dense source family are:

        source_model_type (`str`, defaults to `"llama"`): the transformers model type of the dense family whose
            attention, RMS norm and rotary embedding modules the model uses as they are (`"llama"`, `"mistral"`,
            `"qwen2"`, `"qwen3"`, `"phi3"`): q/k/v biases, q/k norms, fused `qkv_proj`, partial RoPE and sliding
            windows stay the source's. The family's other config fields (`original_max_position_embeddings`, ...)
            are kept in this config, where its modules read them.
        layer_types (`list[str]`, *optional*): `"full_attention"` or `"sliding_attention"` per decoder layer.
            Defaults to sliding attention everywhere when `sliding_window` is set (Mistral, Phi-3), else full.
        sliding_window (`int`, *optional*): the window of the sliding-attention layers.
    """

    source_model_type: str = "llama"
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        super().__post_init__(**kwargs)
        self.validate_source()
        # The attention shards by the source family's own rules (its fused or biased projections, q/k norms).
        attention = CONFIG_MAPPING[self.source_model_type].base_model_tp_plan or {}
        attention = {k: v for k, v in attention.items() if ".self_attn." in k}
        self.base_model_tp_plan = {**attention, **type(self).base_model_tp_plan}

    def validate_architecture(self):
        """Part of `@strict` validation."""
        super().validate_architecture()
        self.validate_source()

    def validate_source(self):
        if self.source_model_type not in CONFIG_MAPPING:
            raise ValueError(
                f"source_model_type {self.source_model_type!r} is not a model type of the installed transformers."
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers.")


@strict
class LlamaMoEConfig(LlamaLikeConfig):
    r"""
    Configuration of a LLaMA-like model whose feed-forward blocks are (partly) Mixture-of-Experts blocks.

    Every field of [`LlamaLikeConfig`] (LLaMA's and the source family's) keeps its meaning. The MoE fields are:

        num_experts (`int`, defaults to 8): routed experts per MoE layer.
        num_experts_per_tok (`int`, defaults to 2): experts each token is routed to (top-k).
        moe_intermediate_size (`int`, *optional*): intermediate size of one routed expert. Defaults to
            `intermediate_size // num_experts` (an even split of the dense FFN).
        num_shared_experts (`int`, defaults to 0): always-on experts (LLaMA-MoE v2 residual MoE). They are stored
            fused as one MLP of size `num_shared_experts * shared_expert_intermediate_size`.
        shared_expert_intermediate_size (`int`, *optional*): intermediate size of one shared expert. Defaults to
            `moe_intermediate_size`.
        score_scale_factor (`float` or `list[float]`, defaults to 1.0): LLaMA-MoE's rescaling of the routed expert
            outputs; one value for all layers or one per decoder layer.
        router_type (`str`, defaults to `"top_k"`):
            - `"top_k"`: softmax over all experts, keep the top-k, renormalise them to sum to 1 (Mixtral, LLaMA-MoE).
            - `"switch"`: softmax over all experts, keep the top-k without renormalising (Switch Transformer with k=1).
            - `"noisy_top_k"`: `"top_k"` with learned, input-dependent Gaussian noise added to the logits in training
              only (Shazeer et al., 2017).
            - `"selector"`: MoEfication's expert selector, `Linear(H, E) -> tanh -> Linear(E, E)` (`mlp.gate.weight`,
              `mlp.gate.bias`, `mlp.gate.selector.{weight,bias}`); picks the top-k scores and gives every selected
              expert weight 1 (G-MoEfication), with a straight-through gradient `1 + p - p.detach()`,
              `p = sigmoid(score)`, so the selector keeps training.
            - `"expert_choice"`: expert-choice routing (Zhou et al., 2022) in training: softmax over the experts per
              token, then each expert takes the C tokens with the highest probability for it and weights its output
              by that probability, `C = ceil(expert_capacity_factor * T * num_experts_per_tok / num_experts)` (at
              most T, the tokens of the forward); a token gets 0 to E experts. A token's routing then depends on the
              other tokens of the batch, later ones included, so it cannot decode one token at a time: outside
              training (`model.eval()`, hence `generate`) the same logits route token-choice like `"top_k"`.
            - `"analytical"`: CMoE's analytical router: expert e scores `|silu(x . g_e) * (x . u_e)|`, its
              representative neuron's activation (`mlp.gate.gate_weight`, `mlp.gate.weight`: the neuron's normalised
              gate and up rows); the top-k of `softmax(scores) + mlp.gate.e_score_correction_bias` (a load-balancing
              buffer, 0 at conversion) win, each weighted `1 + softmax(scores)_e * mlp.gate.weight_scale_e` (0 at
              conversion: unit weights).
        expert_capacity_factor (`float`, defaults to 1.0): capacity factor of `"expert_choice"` routing; 1.0 gives
            each expert an equal share of the `T * num_experts_per_tok` (token, expert) pairs.
        moe_compensation (`bool`, defaults to False): G-MoEfication's representative values. Each MoE layer keeps
            `mlp.compensation` `[E, H]`, row e = `mean_activation_e @ down_proj_e^T` (the expert's output at its mean
            activation over calibration data), and adds the rows of the experts a token did *not* select:
            `output = score_scale_factor * sum_{e in top-k} w_e * expert_e(x) + sum_{e not in top-k} compensation_e`.
            With unit effective weights (`score_scale_factor * w_e == 1`, as the `"selector"` router gives) this is
            the dense FFN with the unselected experts' activations replaced by their means; with every expert
            selected it adds exactly zero. Off: no parameter and no cost.
        router_aux_loss_coef (`float`, defaults to 0.01): weight of the load-balancing loss.
        router_z_loss_coef (`float`, defaults to 0.0): weight of the router z-loss (ST-MoE), averaged over the routers;
            attached to the autograd graph in training, so it trains under any trainer (docs/modeling.md).
        router_mi_loss_coef (`float`, defaults to 0.0): weight of the mutual-information router loss (ModuleFormer):
            per router, the mean entropy of p(e|x) over the tokens minus the entropy of their mean, i.e. minus the
            mutual information between tokens and experts (sharp routing per token, balanced over the batch);
            averaged over the routers and attached to the graph like the z-loss. The MoE block sees no attention
            mask, so padding tokens count in both means.
        output_router_logits (`bool`, defaults to False): return router logits and the auxiliary loss.
        moe_layers (`list[int]`, *optional*): decoder layers that are MoE; the others keep a dense LLaMA MLP.
            Defaults to every layer.
        conversion_info (`dict`, *optional*): how the checkpoint was made (method, seed, source); informational.
    """

    model_type = "llama_moe"
    # Tensor and expert parallelism as in Mixtral / Qwen2-MoE; `mlp.gate_proj` etc. are the dense layers outside
    # `moe_layers`. Routers and the compensation table stay replicated. Each config keeps the rules for the modules it
    # builds (`__post_init__`): transformers treats a rule that matches nothing as a mistake.
    base_model_tp_plan = {
        # attention: the source family's own rules (`__post_init__`)
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }
    base_model_ep_plan = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    score_scale_factor: float | int | list[float] = 1.0
    router_type: str = DEFAULT_ROUTER_TYPE
    expert_capacity_factor: float | int = 1.0
    moe_compensation: bool = False
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    router_mi_loss_coef: float = 0.0
    output_router_logits: bool = False
    moe_layers: list[int] | None = None
    conversion_info: dict | None = None

    def __post_init__(self, **kwargs):
        if self.moe_intermediate_size is None and self.num_experts > 0:
            self.moe_intermediate_size = self.intermediate_size // self.num_experts
        if self.shared_expert_intermediate_size is None:
            self.shared_expert_intermediate_size = self.moe_intermediate_size
        if self.moe_layers is None:
            self.moe_layers = list(range(self.num_hidden_layers))
        if isinstance(self.score_scale_factor, int):
            self.score_scale_factor = float(self.score_scale_factor)
        if isinstance(self.expert_capacity_factor, int):
            self.expert_capacity_factor = float(self.expert_capacity_factor)
        super().__post_init__(**kwargs)
        # Checked here too (not only in the strict validator, which wraps errors) so users get a plain ValueError.
        self.validate_moe()
        self.base_model_tp_plan = {k: v for k, v in self.base_model_tp_plan.items() if self._builds(k)}

    def _builds(self, rule: str) -> bool:
        """Whether this config's model has the modules a parallel-plan rule names."""
        if ".mlp.shared_experts." in rule:
            return bool(self.moe_layers) and self.num_shared_experts > 0
        if ".mlp.experts" in rule:
            return bool(self.moe_layers)
        if ".mlp." in rule:  # the dense MLP of layers outside `moe_layers`
            return len(self.moe_layers) < self.num_hidden_layers
        return True

    def validate_architecture(self):
        """Part of `@strict` validation."""
        super().validate_architecture()
        self.validate_moe()

    def validate_moe(self):
        """One clear `ValueError` per impossible MoE setting."""
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {self.num_experts}.")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok (top-k) must be between 1 and num_experts={self.num_experts}, "
                f"got {self.num_experts_per_tok}."
            )
        if self.moe_intermediate_size is None or self.moe_intermediate_size < 1:
            raise ValueError(
                f"moe_intermediate_size must be a positive integer, got {self.moe_intermediate_size} "
                f"(intermediate_size={self.intermediate_size} split into {self.num_experts} experts)."
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}.")
        if self.num_shared_experts and (self.shared_expert_intermediate_size or 0) < 1:
            raise ValueError("shared_expert_intermediate_size must be a positive integer when shared experts are used.")
        from .routers import ROUTER_CLASSES  # the gates are registered there, one class each

        if self.router_type not in ROUTER_CLASSES:
            raise ValueError(f"Unknown router_type {self.router_type!r}; choose one of {', '.join(ROUTER_CLASSES)}.")
        if isinstance(self.score_scale_factor, list) and len(self.score_scale_factor) != self.num_hidden_layers:
            raise ValueError(
                f"score_scale_factor has {len(self.score_scale_factor)} values but the model has "
                f"{self.num_hidden_layers} layers; give one float or one value per layer."
            )
        bad_layers = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers:
            raise ValueError(f"moe_layers {bad_layers} are outside 0..{self.num_hidden_layers - 1}.")
        if len(set(self.moe_layers)) != len(self.moe_layers):
            raise ValueError(f"moe_layers has duplicates: {self.moe_layers}.")
        if self.expert_capacity_factor <= 0:
            raise ValueError(f"expert_capacity_factor must be > 0, got {self.expert_capacity_factor}.")
        if self.router_aux_loss_coef < 0 or self.router_z_loss_coef < 0 or self.router_mi_loss_coef < 0:
            raise ValueError("router_aux_loss_coef, router_z_loss_coef and router_mi_loss_coef must be >= 0.")

    @property
    def num_router_layers(self) -> int:
        """Router modules in the model: the per-router z-loss and MI loss are averaged over them."""
        return max(1, len(self.moe_layers))

    def layer_score_scale(self, layer_idx: int) -> float:
        """The expert output scale of decoder layer `layer_idx`."""
        if isinstance(self.score_scale_factor, list):
            return float(self.score_scale_factor[layer_idx])
        return float(self.score_scale_factor)


__all__ = ["LlamaLikeConfig", "LlamaMoEConfig"]

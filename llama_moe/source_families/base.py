"""What a dense source family tells a conversion: its config and model classes, which of its config fields carry
over, its checkpoint's tensors per layer, and how its layer's tensors map onto the LLaMA layout that the construction
methods read (`mlp.gate_proj`, `mlp.up_proj`, `mlp.down_proj`).

The output model keeps the source's attention, norms and rotary embedding as transformers implements them
(`LlamaLikeConfig.source_model_type`), so attention tensors pass through under the source's own names.
"""

from ..registry import Registry

SOURCE_FAMILIES = Registry("source family", "source families")

# Dense config fields that describe the source file rather than the model.
DROPPED_CONFIG_KEYS = (
    "model_type",
    "architectures",
    "auto_map",
    "transformers_version",
    "dtype",
    "quantization_config",
)
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class SourceFamily:
    """A transformers dense decoder family, registered under its `model_type` with `@SOURCE_FAMILIES.register`."""

    name = ""  # set by SOURCE_FAMILIES.register: the transformers model_type
    description = ""  # one line: the README table, `--help`
    examples = ""  # well-known checkpoints of the family
    attention_features = ""  # what its attention is, in a few words (export refusals name it)
    llama_attention = False  # its attention is LLaMA's exactly (AttnMoE's attention experts need that)
    attention_tensors = ATTENTION_PROJECTIONS  # the attention's weight names under `self_attn.`
    fused_gate_up = False  # the MLP stores `gate_up_proj` [2I, H] (gate rows first) instead of gate/up

    def config_class(self):
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self.name]

    def model_class(self):
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.name])

    def check(self, config: dict, where: str) -> None:
        """Refuse (one ValueError) what the converter cannot keep exactly; `config` is the config.json dict."""
        if config.get("mlp_bias"):
            raise ValueError(f"{where} has mlp_bias=True; expert construction supports bias-free SwiGLU MLPs only.")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where} has hidden_act={config['hidden_act']!r}; the experts are SwiGLU (silu) MLPs.")

    def layer_types(self, config) -> list[str]:
        """Full or sliding attention per layer: the config's `layer_types` (Qwen2/3), else a window in every layer
        when `sliding_window` is set (Mistral, Phi-3)."""
        if getattr(config, "layer_types", None):
            return list(config.layer_types)
        kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
        return [kind] * config.num_hidden_layers

    def config_fields(self, config) -> dict:
        """The model fields of the dense config, to build an MoE config from (`LlamaMoEConfig(**fields, ...)`)."""
        fields = {k: v for k, v in config.to_dict().items() if k not in DROPPED_CONFIG_KEYS and not k.startswith("_")}
        return {**fields, "source_model_type": self.name, "layer_types": self.layer_types(config)}

    def required_tensors(self, config, layer_idx: int) -> list[str]:
        """The weights every decoder layer of the family has (checked before anything is written)."""
        prefix = f"model.layers.{layer_idx}."
        mlp = ("gate_up_proj", "down_proj") if self.fused_gate_up else MLP_PROJECTIONS
        return [f"{prefix}mlp.{p}.weight" for p in mlp] + [
            f"{prefix}self_attn.{p}.weight" for p in self.attention_tensors
        ]

    def to_llama_layout(self, tensors: dict) -> dict:
        """One layer's tensors (keyed under the layer) with the MLP in LLaMA's layout; the rest as they are."""
        if not self.fused_gate_up or "mlp.gate_up_proj.weight" not in tensors:
            return tensors
        tensors = dict(tensors)
        gate, up = tensors.pop("mlp.gate_up_proj.weight").chunk(2, dim=0)
        return {**tensors, "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up}


def source_family(config: dict, where: str) -> SourceFamily:
    """The source family of a dense config.json dict, checked; one ValueError naming the supported ones."""
    model_type = config.get("model_type")
    if model_type not in SOURCE_FAMILIES:
        raise ValueError(
            f"{where} is a {model_type!r} model; the dense families that convert are {', '.join(SOURCE_FAMILIES)} "
            "(transformers model types)."
        )
    family = SOURCE_FAMILIES[model_type]()
    family.check(config, where)
    return family


def dense_config_fields(config) -> dict:
    """The model fields of a dense config of a supported family, to build an MoE config from."""
    return source_family(config.to_dict(), type(config).__name__).config_fields(config)

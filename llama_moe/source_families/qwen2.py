"""Qwen2 (`model_type: qwen2`): q/k/v projections with biases (o_proj without), sliding windows in the layers
`layer_types` names."""

from .base import SOURCE_FAMILIES, SourceFamily


@SOURCE_FAMILIES.register("qwen2")
class Qwen2(SourceFamily):
    description = "Qwen2 / Qwen2.5: q/k/v biases, per-layer sliding windows, tied embeddings in small models"
    examples = "Qwen2.5-0.5B to 72B"
    attention_features = "q/k/v biases"

"""Qwen3 (`model_type: qwen3`): RMS norms on the queries and keys per head, an explicit `head_dim`, optional
attention biases, per-layer sliding windows."""

from .base import SOURCE_FAMILIES, SourceFamily


@SOURCE_FAMILIES.register("qwen3")
class Qwen3(SourceFamily):
    description = "Qwen3: q/k RMS norms, explicit head_dim, per-layer sliding windows"
    examples = "Qwen3-0.6B to 32B"
    attention_features = "q/k RMS norms"

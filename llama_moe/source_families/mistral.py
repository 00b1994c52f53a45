"""Mistral (`model_type: mistral`): LLaMA's layout with sliding-window attention in every layer when
`sliding_window` is set."""

from .base import SOURCE_FAMILIES, SourceFamily


@SOURCE_FAMILIES.register("mistral")
class Mistral(SourceFamily):
    description = "Mistral: LLaMA's layout, sliding-window attention, explicit head_dim"
    examples = "Mistral 7B, Ministral"
    attention_features = "LLaMA attention with sliding windows"

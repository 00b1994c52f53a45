"""LLaMA (`model_type: llama`): LLaMA 1-3, SmolLM2, TinyLlama; also what a GGUF source is read as."""

from .base import SOURCE_FAMILIES, SourceFamily


@SOURCE_FAMILIES.register("llama")
class Llama(SourceFamily):
    description = "LLaMA: RoPE (with its scalings), optional attention biases, GQA"
    examples = "Llama 2/3, SmolLM2, TinyLlama"
    attention_features = "LLaMA attention"
    llama_attention = True

"""Phi-3 (`model_type: phi3`): fused `qkv_proj` and `gate_up_proj`, partial rotary embeddings, LongRoPE.

Its attention stays fused (the output uses transformers' `Phi3Attention`); its MLP's `gate_up_proj` [2I, H] is
split, gate rows first, into the LLaMA layout the construction methods read (dense layers keep that layout too).
"""

from .base import SOURCE_FAMILIES, SourceFamily


@SOURCE_FAMILIES.register("phi3")
class Phi3(SourceFamily):
    description = "Phi-3: fused qkv_proj and gate_up_proj, partial RoPE, LongRoPE, sliding windows"
    examples = "Phi-3/3.5-mini, Phi-4-mini"
    attention_features = "a fused qkv_proj, partial RoPE"
    attention_tensors = ("qkv_proj", "o_proj")
    fused_gate_up = True

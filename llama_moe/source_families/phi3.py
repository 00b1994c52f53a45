"""Phi-3 (`model_type: phi3`): fused `qkv_proj` and `gate_up_proj`, partial rotary embeddings, LongRoPE.

Its attention stays fused (the output uses transformers' `Phi3Attention`); its MLP's `gate_up_proj` [2I, H] is
split, gate rows first, into the LLaMA layout the construction methods read (dense layers keep that layout too).
Phi-3's residual and embedding dropout (`resid_pdrop`, `embd_pdrop`: 0 in the released checkpoints) are not applied
in training; a source with either above 0 is refused.
"""

from .base import SOURCE_FAMILIES, SourceFamily


@SOURCE_FAMILIES.register("phi3")
class Phi3(SourceFamily):
    description = "Phi-3: fused qkv_proj and gate_up_proj, partial RoPE, LongRoPE, sliding windows"
    examples = "Phi-3/3.5-mini, Phi-4-mini"
    attention_features = "a fused qkv_proj, partial RoPE"
    attention_tensors = ("qkv_proj", "o_proj")
    fused_gate_up = True

    def check(self, config: dict, where: str) -> None:
        super().check(config, where)
        dropout = {k: config[k] for k in ("resid_pdrop", "embd_pdrop") if config.get(k)}
        if dropout:
            raise ValueError(f"{where} has {dropout}: the MoE's decoder layers apply no residual or embedding dropout.")

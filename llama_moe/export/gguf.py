"""llama.cpp's GGUF, in the layout llama.cpp's `convert_hf_to_gguf.py` writes Mixtral (and a dense LLaMA source as it
writes LLaMA, so that a dense model and its MoE go through the same writer): architecture "llama" with
`expert_count` / `expert_used_count`, the router as `blk.N.ffn_gate_inp.weight` and the experts stacked as
`blk.N.ffn_{gate,up,down}_exps.weight` ([E, m, H], [E, m, H], [E, H, m]); q and k permuted for llama.cpp's rotary
layout (`LlamaModel.permute`). One file, `model.gguf`, with the tokenizer in its metadata.

It exports exactly what the Mixtral target does (llama.cpp's "llama" MoE graph is Mixtral's: softmax, top-k,
renormalised, every layer MoE). A model with always-on shared experts, or with leading dense layers, is written with
architecture "ernie4_5-moe" instead: llama.cpp's graph for it is the same attention (RMSNorm, RoPE with llama's
rotation, no biases) and the same renormalised softmax top-k, plus an ungated shared expert of S neurons added with
weight 1 (`ffn_{gate,up,down}_shexp`), and dense FFNs in the first `leading_dense_block_count` layers
(llama.cpp's `src/models/ernie4-5-moe.cpp`, in the llama.cpp that llama-cpp-python 0.3.36 vendors). llama.cpp's
"qwen2moe" graph is no way out for shared experts: it never renormalises the top-k and computes its shared-expert
gate as `silu(x) / x`, which is 0/0 for the zero gate weight that a constant gate of 1/2 needs. Dense layers after an
MoE layer, and the switch router (top-k not renormalised), are refused.

Weights are F32, F16 or BF16 (`dtype`), or Q8_0 (`outtype q8_0`: gguf's own quantizer, as llama.cpp's converter's
`--outtype q8_0`); 1-D tensors, norms and routers are F32, as llama.cpp's converter writes them.
RoPE: default, linear, and llama3 (its frequency factors as `rope_freqs.weight`, from transformers' own llama3 rule).

Tokenizer: SentencePiece (`tokenizer.model`, needs the `sentencepiece` package), Llama-style BPE and GPT-2 byte-level
BPE (`tokenizer.json`) through gguf's vocab readers, with special-token ids, merges and the chat template
(`gguf.SpecialVocab`). llama.cpp's converter identifies a BPE tokenizer's pre-tokenizer (`tokenizer.ggml.pre`) by
hashing its output on a test text against its own table: that table is not in the gguf package, so the name is the
`tokenizer_pre` option (default: llama.cpp's "default" regex, noted when used). A tokenizer of another kind (e.g.
WordLevel) is not written: the file then has no vocabulary (`tokenizer.ggml.model = "none"`), and that is noted.
"""

import dataclasses

from ..registry import option
from .base import ExportTarget, attention_reasons, dense_layers, keeps_weights_summing_to_one
from .registry import TARGETS

GGUF_FILE = "model.gguf"
ROPE_TYPES = ("default", "linear", "llama3")
# role -> gguf.MODEL_TENSOR name, as llama.cpp's tensor map names Mixtral's tensors
GGUF_TENSORS = {
    "embed": "TOKEN_EMBD",
    "norm": "OUTPUT_NORM",
    "lm_head": "OUTPUT",
    "attn_norm": "ATTN_NORM",
    "ffn_norm": "FFN_NORM",
    "q": "ATTN_Q",
    "k": "ATTN_K",
    "v": "ATTN_V",
    "o": "ATTN_OUT",
    "dense_gate": "FFN_GATE",
    "dense_up": "FFN_UP",
    "dense_down": "FFN_DOWN",
    "router": "FFN_GATE_INP",
    "gate_exps": "FFN_GATE_EXP",
    "up_exps": "FFN_UP_EXP",
    "down_exps": "FFN_DOWN_EXP",
    "shexp_gate": "FFN_GATE_SHEXP",
    "shexp_up": "FFN_UP_SHEXP",
    "shexp_down": "FFN_DOWN_SHEXP",
}
LLAMA, ERNIE_MOE = "llama", "ernie4_5-moe"  # llama.cpp's architectures: Mixtral's graph, and with shared experts


OUTTYPES = ("auto", "q8_0")


@dataclasses.dataclass(frozen=True)
class GGUFOptions:
    outtype: str = option(
        "auto",
        "gguf: the weight matrices' type: auto (--dtype's: f32, f16 or bf16) or q8_0 (8-bit blocks of 32, gguf's "
        "quantizer; a matrix whose rows are not a multiple of 32 is written F16)",
        choices=OUTTYPES,
    )
    tokenizer_pre: str = option(
        "default",
        "gguf: llama.cpp's name of a byte-level BPE tokenizer's pre-tokenizer (tokenizer.ggml.pre), e.g. smollm, "
        "llama-bpe, qwen2 (llama.cpp's converter finds it by a hash table the gguf package lacks)",
    )


def graph_reasons(config) -> list[str]:
    """What llama.cpp's "llama" graph computes otherwise, MoE or dense."""
    reasons = [f"hidden_act {config.hidden_act!r}: llama.cpp runs SiLU"] if config.hidden_act != "silu" else []
    if rope_type(config) not in ROPE_TYPES:
        reasons.append(f"rope_type {rope_type(config)!r}: GGUF export supports {', '.join(ROPE_TYPES)}")
    return reasons


def architecture(config) -> str:
    """llama.cpp's architecture of the file: "llama", or "ernie4_5-moe" for shared experts or leading dense layers."""
    if getattr(config, "num_experts", None) and (config.num_shared_experts or dense_layers(config)):
        return ERNIE_MOE
    return LLAMA


def layout_reasons(config) -> list[str]:
    """Why neither llama.cpp graph (Mixtral's, or ERNIE 4.5 MoE's with shared experts) expresses the MoE layers."""
    reasons = []
    if not keeps_weights_summing_to_one(config):
        reasons.append(
            f"router_type {config.router_type!r} keeps the top-k softmax probabilities as they are, llama.cpp's MoE "
            "graphs renormalise them (qwen2_moe has norm_topk_prob=False)"
        )
    if config.attention_bias:
        reasons.append("attention biases: llama.cpp's llama graph has none")
    dense = dense_layers(config)
    if dense != list(range(len(dense))):
        reasons.append(f"the dense layers {dense}: llama.cpp's MoE graphs take dense layers only before the MoE ones")
    if architecture(config) == ERNIE_MOE and rope_type(config) == "llama3":
        reasons.append(
            "llama3 RoPE with shared experts or dense layers: llama.cpp's ernie4_5-moe graph has no rope_freqs"
        )
    return reasons


def rope_type(config) -> str:
    return (config.rope_parameters or {}).get("rope_type", "default")


def tensor_name(kind: str, layer: int | None = None) -> str:
    """The GGUF name of tensor `kind` (a `gguf.MODEL_TENSOR` member name) of decoder layer `layer`."""
    import gguf

    return gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)].format(bid=layer) + ".weight"


def rope_permute(weight, heads: int):
    """llama.cpp's `LlamaModel.permute`: each head's rows [first halves | second halves] (transformers' rotate_half
    layout) become interleaved pairs (llama.cpp's). weight [heads * d, H] -> [heads, 2, d/2, H] -> pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


@TARGETS.register("gguf")
class GGUF(ExportTarget):
    description = (
        "llama.cpp's GGUF (model.gguf), architecture 'llama' with experts as llama.cpp writes Mixtral (what the "
        "mixtral target maps), or 'ernie4_5-moe' for shared experts and leading dense layers; the tokenizer in the "
        "metadata."
    )
    Options = GGUFOptions
    dense_sources = ("llama",)  # the dense model too, as llama.cpp's "llama" graph without experts

    @classmethod
    def target_reasons(cls, config) -> list[str]:
        reasons = layout_reasons(config) + attention_reasons(config, "gguf", ("llama",))
        return reasons + graph_reasons(config)

    @classmethod
    def dense_reasons(cls, config) -> list[str]:
        biases = ["attention biases: llama.cpp's llama graph has none"] if config.attention_bias else []
        biases += ["mlp_bias: llama.cpp's llama graph has none"] if config.mlp_bias else []
        return biases + graph_reasons(config)

    def rope_type(self) -> str:
        return rope_type(self.config)

    def architecture(self) -> str:
        return architecture(self.config)

    def extra_tensors(self):
        if self.rope_type() == "llama3":
            yield tensor_name("ROPE_FREQS"), llama3_rope_factors(self.config)

    def role_tensors(self, role, layer, tensor):
        config = self.config
        if role == "q":
            tensor = rope_permute(tensor, config.num_attention_heads)
        elif role == "k":
            tensor = rope_permute(tensor, config.num_key_value_heads)
        yield tensor_name(GGUF_TENSORS[role], layer), tensor

    def write(self, job) -> list[str]:
        from .gguf_file import write_gguf

        write_gguf(job, job.folder / GGUF_FILE)
        return [GGUF_FILE]


def llama3_rope_factors(config):
    """llama.cpp's `rope_freqs`: per frequency, the divisor turning the default RoPE frequency into llama3's,
    computed with transformers' own rules (the model's inverse frequencies are default / factor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    default, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return (default / llama3).float()  # [head_dim / 2]

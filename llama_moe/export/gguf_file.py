"""Writing the GGUF file of the `gguf` target one tensor at a time, with gguf's own writer and vocab readers.

The header, metadata and tensor table are written from the plan first (`GGUFWriter.add_tensor_info`), then each
tensor's bytes as the export produces it (`write_tensor_data`, in the planned order): memory stays at one
checkpoint tensor, as in the safetensors targets.
"""

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

from .base import dense_layers

# dtype of the weights -> (GGML type of the weight matrices, the file's type), as llama.cpp's --outtype f32/f16/bf16
FILE_TYPES = {
    torch.float32: (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    torch.float16: (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    torch.bfloat16: (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
}
Q8_0 = (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)
ROUTER = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP].split(".")[-1]  # "ffn_gate_inp"
PADDING_SCORE = -10000.0  # llama.cpp's converter's score of the tokens it adds up to the model's vocab_size


def write_gguf(job, path: Path) -> None:
    """Write `job`'s planned tensors, streamed, with the model and tokenizer metadata into `path`."""
    config, target = job.target.config, job.target
    matrix_type, file_type = Q8_0 if target.options.outtype == "q8_0" else FILE_TYPES[job.dtype]
    writer = gguf.GGUFWriter(path, target.architecture())
    add_model_metadata(writer, config, file_type, name=job.checkpoint.path.name)
    target.notes += add_vocabulary(writer, job.checkpoint.path, config.vocab_size, target.options.tokenizer_pre)
    types = {name: tensor_type(name, shape, matrix_type) for name, shape in job.plan.items()}
    for name, shape in job.plan.items():
        nbytes = math.prod(gguf.quant_shape_to_byte_shape(shape, types[name]))
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=types[name])
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    planned = iter(job.plan)
    try:
        for name, tensor in job.tensors():
            # GGUFWriter writes the bytes it is given in its table's order: a tensor out of order would be misplaced.
            if name != next(planned):
                raise RuntimeError(f"GGUF export produced {name} out of the planned order.")
            data = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
            writer.write_tensor_data(gguf.quants.quantize(data, types[name]))
    finally:
        writer.close()


def tensor_type(name: str, shape: tuple[int, ...], matrix_type):
    """llama.cpp's converter's rule: 1-D tensors, norms and routers in F32, the other matrices in the file's type
    (F16 where a quantized type's blocks do not divide the rows)."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or f".{ROUTER}." in name:
        return gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[matrix_type]
    return matrix_type if shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16


def add_model_metadata(writer, config, file_type, name: str) -> None:
    """The "llama" architecture's hyperparameters, with experts as llama.cpp's converter writes Mixtral's; or
    "ernie4_5-moe"'s, whose experts and shared experts have widths of their own (`architecture`)."""
    rope = config.rope_parameters or {}
    writer.add_name(name)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    experts = getattr(config, "num_experts", None)  # None: a dense source
    ernie = writer.arch == gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.ERNIE4_5_MOE]
    # llama.cpp's "llama" sizes the graph's experts by n_ff, and a dense model's FFN; ERNIE's n_ff is the dense layers'
    writer.add_feed_forward_length(config.moe_intermediate_size if experts and not ernie else config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if ernie:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.num_shared_experts * config.shared_expert_intermediate_size)
        writer.add_interleave_moe_layer_step(1)
        writer.add_leading_dense_block_count(len(dense_layers(config)))
    writer.add_file_type(file_type)


def read_vocab(folder: Path):
    """The tokenizer through gguf's readers, in the order llama.cpp's converter tries them for LLaMA models; None if
    it is none of them."""
    for reader in (gguf.SentencePieceVocab, gguf.LlamaHfVocab, gguf.BpeVocab):
        try:
            return reader(folder)
        except (FileNotFoundError, TypeError, RuntimeError):  # another kind (RuntimeError: sentencepiece missing)
            continue
    return None


def add_vocabulary(writer, folder: Path, vocab_size: int, pre: str) -> list[str]:
    """Tokens (padded to the model's vocab_size), their scores and types, special ids, merges and chat template;
    returns notes on what could not be written exactly."""
    vocab = read_vocab(folder)
    if vocab is None:
        writer.add_tokenizer_model("none")
        return [
            "GGUF: the tokenizer is neither SentencePiece (tokenizer.model, with the sentencepiece package) nor a "
            "BPE tokenizer.json, so the file has no vocabulary (llama.cpp can still run it on token ids)"
        ]
    tokens, scores, types = (list(column) for column in zip(*vocab.all_tokens()))
    if len(tokens) > vocab_size:
        raise ValueError(f"The tokenizer has {len(tokens)} tokens, more than the model's vocab_size {vocab_size}.")
    notes = []
    writer.add_tokenizer_model(vocab.tokenizer_model)
    if vocab.tokenizer_model == "gpt2":
        mark_added_tokens(types, folder / "tokenizer.json")
        writer.add_tokenizer_pre(pre)
        if pre == "default":
            notes.append(
                "GGUF: tokenizer.ggml.pre is 'default' (llama.cpp's default pre-tokenizer regex); pass "
                "--tokenizer-pre NAME with llama.cpp's name for this tokenizer (e.g. smollm, llama-bpe) to match it"
            )
    padding = vocab_size - len(tokens)
    writer.add_token_list(tokens + [f"[PAD{i}]".encode() for i in range(len(tokens), vocab_size)])
    writer.add_token_scores(scores + [PADDING_SCORE] * padding)
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * padding)
    special = gguf.SpecialVocab(folder, load_merges=vocab.tokenizer_model == "gpt2", n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    return notes


def mark_added_tokens(types: list, tokenizer_json: Path) -> None:
    """gguf's BPE reader types added tokens that are also in the base vocabulary (e.g. SmolLM2's <|im_start|>) as
    normal text; llama.cpp's converter types every added token as control when special, else user-defined."""
    if not tokenizer_json.is_file():  # a slow tokenizer (vocab.json): its added tokens follow the base vocabulary
        return
    for added in json.loads(tokenizer_json.read_text(encoding="utf-8")).get("added_tokens", []):
        if added["id"] < len(types):
            types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED

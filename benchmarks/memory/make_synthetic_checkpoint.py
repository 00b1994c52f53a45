"""Write a random dense LLaMA checkpoint of a given shape to disk, shard by shard (never the whole model in memory).

    python benchmarks/memory/make_synthetic_checkpoint.py /tmp/llama7b --shape 7b --dtype bfloat16
    python benchmarks/memory/make_synthetic_checkpoint.py /tmp/llama1b --shape 1b --tokenizer default
    python benchmarks/memory/make_synthetic_checkpoint.py /tmp/synth8b --shape 8b --tokenizer default
    python benchmarks/memory/make_synthetic_checkpoint.py /tmp/synth8b2 --shape 8b --layers 2 --tokenizer default

`--layers N` keeps the shape's layers but N of them: a conversion's time and memory per layer in minutes (its peak
and per-layer time are the whole model's, the totals scale with the layers).

`--tokenizer FOLDER` (`default`: the built-in model's) copies a tokenizer beside the weights, the vocabulary widened
to hold its ids, so that conversions which read text (calibration, healing) run on the checkpoint.

Used by bench_convert_memory.py. The weights are random: only shapes, dtypes and file layout matter.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import LlamaConfig

SHAPES = {
    "8b": dict(  # Llama-3-8B
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
    ),
}


def layer_shapes(config: LlamaConfig, i: int) -> dict[str, tuple[int, ...]]:
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": (config.num_attention_heads * d, h),
        p + "self_attn.k_proj.weight": (config.num_key_value_heads * d, h),
        p + "self_attn.v_proj.weight": (config.num_key_value_heads * d, h),
        p + "self_attn.o_proj.weight": (h, config.num_attention_heads * d),
        p + "mlp.gate_proj.weight": (f, h),
        p + "mlp.up_proj.weight": (f, h),
        p + "mlp.down_proj.weight": (h, f),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }


def write_checkpoint(
    out: Path, shape: str, dtype: torch.dtype, layers_per_shard: int, tokenizer=None, layers: int | None = None
) -> None:
    out.mkdir(parents=True, exist_ok=False)
    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if tokenizer is not None:
        fields["vocab_size"] = max(fields["vocab_size"], _copy_tokenizer(Path(tokenizer), out))
    config = LlamaConfig(**fields, tie_word_embeddings=False)
    config.dtype = dtype
    config.save_pretrained(out)
    groups = [
        {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)},
        *[
            {
                k: v
                for i in range(start, min(start + layers_per_shard, config.num_hidden_layers))
                for k, v in layer_shapes(config, i).items()
            }
            for start in range(0, config.num_hidden_layers, layers_per_shard)
        ],
        {"model.norm.weight": (config.hidden_size,), "lm_head.weight": (config.vocab_size, config.hidden_size)},
    ]
    weight_map, total = {}, 0
    generator = torch.Generator().manual_seed(0)
    for n, group in enumerate(tqdm(groups, desc="writing shards")):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: (torch.randn(s, generator=generator) * 0.02).to(dtype) for k, s in group.items()}
        save_file(tensors, out / name, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _copy_tokenizer(folder: Path, out: Path) -> int:
    """The tokenizer files of `folder` copied into `out`; the tokenizer's vocabulary size."""
    from transformers import AutoTokenizer

    from llama_moe.checkpoints.folder import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    return len(AutoTokenizer.from_pretrained(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--layers-per-shard", type=int, default=2)
    parser.add_argument("--layers", type=int, help="this many decoder layers instead of the shape's")
    parser.add_argument(
        "--tokenizer", help="a folder whose tokenizer to copy beside the weights (default: the built-in model's)"
    )
    args = parser.parse_args()
    tokenizer = args.tokenizer
    if tokenizer == "default":
        from llama_moe.checkpoints.default import default_model_path

        tokenizer = default_model_path()
    write_checkpoint(args.output, args.shape, getattr(torch, args.dtype), args.layers_per_shard, tokenizer, args.layers)


if __name__ == "__main__":
    main()

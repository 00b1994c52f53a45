"""Give the built-in model folder random weights of its own shape, for a GPU machine that reaches no network.

Copy the folder's config and tokenizer files (`config.json`, `generation_config.json`, `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`, a few MB) from a machine that prepared the default model into
`$LLAMA_MOE_HF_CACHE/SmolLM2-135M-Instruct`, then run this there: it writes `model.safetensors` (seed 0). Kernels and
speeds do not depend on the weights' values; perplexities measured on such a model mean nothing.

    python benchmarks/gpu/random_default_model.py
"""

import torch
from transformers import AutoConfig, LlamaForCausalLM

from llama_moe.checkpoints.default import DEFAULT_MODEL_NAME, cache_dir


def main():
    folder = cache_dir() / DEFAULT_MODEL_NAME
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder} has no config.json: copy the default model's config and tokenizer files first.")
    if (folder / "model.safetensors").exists():
        raise SystemExit(f"{folder} already has weights; nothing written.")
    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    print(f"random weights of {DEFAULT_MODEL_NAME}'s shape in {folder}")


if __name__ == "__main__":
    main()

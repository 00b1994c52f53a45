"""Reading dense source checkpoints."""

from pathlib import Path

import torch


def load_gguf_model(gguf_path: str | Path, dtype: torch.dtype = torch.float32):
    """Load a LLaMA-architecture GGUF file as a plain (dequantised) `LlamaForCausalLM`.

    transformers dequantises GGUF weights on load but keeps a `quantization_config`, which makes `save_pretrained` and
    `Trainer` refuse the model; rebuilding from a clean config gives an ordinary model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    gguf_path = Path(gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("dtype", None)
    config = AutoConfig.for_model(**config_dict)
    if config.model_type != "llama":
        raise ValueError(f"{gguf_path.name} holds a {config.model_type!r} model; only LLaMA-architecture models convert.")
    model = LlamaForCausalLM(config).to(dtype)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return model.eval()

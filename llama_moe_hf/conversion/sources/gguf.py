"""GGUF files of LLaMA models (llama.cpp's format), dequantised into a plain transformers model."""

from pathlib import Path

import torch

from .memory import ModelSource


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
        raise ValueError(
            f"{gguf_path.name} holds a {config.model_type!r} model; only LLaMA-architecture models convert."
        )
    model = LlamaForCausalLM(config).to(dtype)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return model.eval()


class GGUFSource(ModelSource):
    """A LLaMA GGUF file, dequantised into memory once (GGUF files of LLaMA models that fit in RAM)."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoTokenizer

        try:
            model = load_gguf_model(path, dtype=dtype)
        except (ValueError, FileNotFoundError):
            raise
        except Exception as error:
            raise ValueError(f"Cannot read {path} as a LLaMA GGUF file: {error}") from None
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        super().__init__(model, tokenizer, path, description=f"{path.name} (GGUF, dequantised)")

    def save_extras(self, out_dir: Path) -> None:
        self._tokenizer.save_pretrained(out_dir)
        self._model.generation_config.save_pretrained(out_dir)

    def load_model(self, dtype: torch.dtype | None = None, device: str | None = None):
        return self._model.to(device=device, dtype=dtype or self._model.dtype)  # our own copy: free to move

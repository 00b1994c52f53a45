"""GGUF files of LLaMA models (llama.cpp's format), read one tensor at a time and dequantised as they are read."""

import mmap
from pathlib import Path

import numpy as np
import torch

from ..source_families import source_family
from .base import DenseSource


def load_gguf_model(gguf_path: str | Path, dtype: torch.dtype = torch.float32):
    """Load a LLaMA-architecture GGUF file as a plain (dequantised) `LlamaForCausalLM`.

    transformers dequantises GGUF weights on load but keeps a `quantization_config`, which makes `save_pretrained` and
    `Trainer` refuse the model; rebuilding from a clean config gives an ordinary model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

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


class GGUFSource(DenseSource):
    """A LLaMA GGUF file, memory-mapped: each tensor is dequantised when it is read, named and un-permuted as
    transformers' GGUF loader does (its name map and tensor processor), so a streaming conversion holds about one
    tensor, as with safetensors sources. The whole model is loaded only for calibration passes (`load_model`)."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32):
        from gguf import GGUFReader
        from transformers import AutoConfig

        import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

        try:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            self._reader = GGUFReader(path)
        except Exception as error:
            raise ValueError(f"Cannot read {path} as a LLaMA GGUF file: {error}") from None
        if source_family(config.to_dict(), path.name).name != "llama":  # transformers' GGUF name maps are LLaMA's here
            raise ValueError(f"{path.name} holds a {config.model_type!r} model; GGUF sources convert from LLaMA only.")
        super().__init__(path, config, description=f"{path.name} (GGUF, dequantised)")
        self._dtype = dtype
        self._tensors, self._processor = self._name_map()

    def _name_map(self) -> tuple[dict, object]:
        """transformers' name -> the GGUF tensor, and the tensor processor that undoes llama.cpp's q/k permutation.
        GGUF tensors transformers does not load (llama3's `rope_freqs`, recomputed from the config) are left out."""
        from transformers import LlamaForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

        processor = TENSOR_PROCESSORS["llama"](config=self.config.to_dict())
        with torch.device("meta"):
            gguf_to_hf = get_gguf_hf_weights_map(LlamaForCausalLM(self.config), processor)
        return {gguf_to_hf[t.name]: t for t in self._reader.tensors if t.name in gguf_to_hf}, processor

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> torch.Tensor:
        from gguf import dequantize

        stored = self._tensors[name]
        weights = self._processor.process(weights=dequantize(stored.data, stored.tensor_type), name=stored.name).weights
        # Dequantised types are fresh float32 arrays; F32 tensors are views of the read-only file: copy those only.
        tensor = torch.from_numpy(np.require(weights, np.float32, ["C", "W"])).to(self._dtype)
        self._release(stored)
        return tensor

    def _release(self, stored) -> None:
        """Drop the file's pages under this tensor from the process (they are clean: reading again refaults them), so
        resident memory stays about one tensor rather than growing to the whole mapped file."""
        start = -(-stored.data_offset // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor's bytes
        end = (stored.data_offset + stored.n_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._reader.data.base.madvise(mmap.MADV_DONTNEED, start, end - start)  # the reader's np.memmap's mmap

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def save_extras(self, out_dir: Path) -> None:
        from transformers import GenerationConfig

        self.load_tokenizer().save_pretrained(out_dir)
        GenerationConfig.from_model_config(self.config).save_pretrained(out_dir)

    def load_model(self, dtype: torch.dtype | None = None, device: str | None = None):
        return load_gguf_model(self.path, dtype=dtype or self._dtype).to(device)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)

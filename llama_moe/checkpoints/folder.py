"""Local transformers folders (and Hub downloads of them): safetensors read one tensor at a time, memory-mapped."""

import json
import logging
import shutil
from pathlib import Path

import torch
from huggingface_hub import ModelCard
from safetensors import SafetensorError, safe_open

from ..source_families import source_family
from .base import DenseSource

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


def read_tokenizer(source, **kwargs):
    """`AutoTokenizer.from_pretrained(source, **kwargs)`; a ValueError naming `source` for files that do not parse
    (a truncated tokenizer.json gives a bare "EOF while parsing" or JSON error from deep inside)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as error:  # tokenizers raises plain `Exception` for a file it cannot parse
        raise ValueError(f"Cannot read the tokenizer of {source}: {error} (a corrupt or truncated file?)") from error


# What a Hub download fetches: configs, safetensors weights and tokenizer files, never pickles or other formats.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "merges.txt", "*.jinja", "README.md"]


class FolderSource(DenseSource):
    """A transformers folder: config.json plus safetensors weights (one file or shards with an index)."""

    def __init__(self, path: Path, hub_id: str | None = None, allow_pickle: bool = False, tokenizer: str | None = None):
        config = self.read_config(path)
        super().__init__(path, config, hub_id=hub_id, description=hub_id or str(path))
        # --tokenizer: a folder (by its full path, as --model) or Hub id whose tokenizer replaces the folder's own
        local = tokenizer and Path(tokenizer).expanduser()
        self.tokenizer_source = str(local.resolve()) if local and local.exists() else tokenizer
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

    @staticmethod
    def read_config(path: Path):
        """The folder's config, refused before any weight is read unless it is of a supported dense source family
        (subclasses read other kinds of checkpoint folders). The family's own config class reads it: a config that
        names remote code (`auto_map`) never runs it."""
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{path} has no config.json; pass a transformers model folder, a Hub id or a .gguf."
            )
        try:
            family = source_family(json.loads(config_file.read_text()), str(path))
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_file} is not valid JSON: {error}") from None
        return family.config_class().from_pretrained(path)

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

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self._open(self._files[name])  # from the header: the tensor stays unread
        return tuple(handle[name].shape if isinstance(handle, dict) else handle.get_slice(name).get_shape())

    @property
    def dtype(self) -> torch.dtype:
        """Read from one row of the embedding: the whole of it can be a gigabyte."""
        name = "model.embed_tokens.weight"
        handle = self._open(self._files[name])
        return handle[name].dtype if isinstance(handle, dict) else handle.get_slice(name)[:1].dtype

    def save_extras(self, out_dir: Path) -> None:
        from transformers import GenerationConfig

        tokenizer_files = [name for name in TOKENIZER_FILES if (self.path / name).is_file()]
        if self.tokenizer_source:
            self.load_tokenizer().save_pretrained(out_dir)
        else:
            for name in tokenizer_files:
                shutil.copyfile(self.path / name, out_dir / name)
        if not (tokenizer_files or self.tokenizer_source):
            logger.warning("%s has no tokenizer files; the output has none either (--tokenizer gives one).", self.path)
        if (self.path / "generation_config.json").is_file():
            shutil.copyfile(self.path / "generation_config.json", out_dir / "generation_config.json")
        else:
            GenerationConfig.from_model_config(self.config).save_pretrained(out_dir)

    def load_model(self, dtype: torch.dtype | None = None, device: str | None = None):
        model_class = self.family.model_class()
        return model_class.from_pretrained(self.path, dtype=dtype or self.dtype, device_map=device).eval()

    def load_tokenizer(self):
        """--tokenizer's tokenizer, else the folder's own; one clear error for a folder without one (transformers
        would say that sentencepiece is missing)."""
        source = self.tokenizer_source or self.path
        if Path(source).is_dir() and not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
            if self.tokenizer_source:
                raise ValueError(f"--tokenizer {source} has no tokenizer files (tokenizer.json or tokenizer.model).")
            raise ValueError(
                f"{self.description} has no tokenizer (no tokenizer.json or tokenizer.model); give one with "
                "--tokenizer FOLDER_OR_HUB_ID (tokenizer=), e.g. the original model's."
            )
        tokenizer = read_tokenizer(source)
        if self.tokenizer_source and len(tokenizer) > self.config.vocab_size:  # ids past the embeddings
            raise ValueError(
                f"The tokenizer of {source} has {len(tokenizer):,} tokens, more than the {self.config.vocab_size:,} "
                f"embeddings of {self.description}: --tokenizer must be the model's own."
            )
        return tokenizer

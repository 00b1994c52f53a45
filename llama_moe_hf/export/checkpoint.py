"""A converted model folder as an export source: read one tensor at a time, memory-mapped, like a dense source."""

from pathlib import Path

from ..conversion.sources.folder import FolderSource


class ConvertedCheckpoint(FolderSource):
    """A converted checkpoint folder (any family of this package): its config, and `FolderSource`'s streaming reads
    of the safetensors, tokenizer files and generation config."""

    @staticmethod
    def read_config(path: Path):
        from transformers import AutoConfig

        from .. import modeling  # noqa: F401  (registers the families: no remote code is run)

        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model folder (no config.json).")
        return AutoConfig.from_pretrained(path)


def open_checkpoint(folder) -> ConvertedCheckpoint:
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a converted model folder.")
    return ConvertedCheckpoint(path)


def check_compensation(checkpoint) -> list[str]:
    """G-MoEfication's compensation adds the rows of the experts a token did not select, which no target has; a
    table of zeros adds nothing and is left out (one ValueError otherwise; notes)."""
    config = checkpoint.config
    if not getattr(config, "moe_compensation", False):
        return []
    for layer in config.moe_layers:
        if checkpoint.tensor(f"model.layers.{layer}.mlp.compensation").any():
            raise ValueError(
                f"Cannot export moe_compensation exactly: layer {layer} adds the compensation rows of the experts a "
                "token did not select (G-MoEfication), which no target can express."
            )
    return ["moe_compensation: every compensation row is zero, so it adds nothing and is not exported"]

"""A dense source checkpoint: its config, its tensor names, and lazy access to one tensor at a time."""

from pathlib import Path

import torch

from ..source_families import SOURCE_FAMILIES


class DenseSource:
    """A dense checkpoint of a source family (`source_families`): its config, its tensor names, and lazy access to
    each tensor.

    path: the folder (or the .gguf file) it was read from. hub_id and license: model card metadata, when known.
    """

    tokenizer_source: str | None = None  # --tokenizer: what replaces the checkpoint's own tokenizer (folders only)

    def __init__(self, path: Path, config, hub_id: str | None = None, description: str | None = None):
        self.path = path
        self.config = config
        self.hub_id = hub_id
        self.description = description or str(path)
        self.license = None
        # The source family (None for a converted checkpoint read like a source: export, `llama-moe heal`)
        self.family = SOURCE_FAMILIES[config.model_type]() if config.model_type in SOURCE_FAMILIES else None
        # What `--model` names to open this source again (saved with the recipe): the Hub id, else the full path.
        self.reference = hub_id or str(Path(path).resolve())

    def names(self) -> list[str]:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape; sources that store it apart from the data (safetensors headers) read no tensor."""
        return tuple(self.tensor(name).shape)

    def save_extras(self, out_dir: Path) -> None:
        """Write the tokenizer files (with the chat template) and generation_config.json into `out_dir`."""
        raise NotImplementedError

    def load_model(self, dtype: torch.dtype | None = None, device: str | None = None):
        """The whole dense model in memory (on `device`, in `dtype`), for the calibration passes."""
        raise NotImplementedError

    def load_tokenizer(self):
        """The source's tokenizer (calibration text is tokenized with it)."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stored floating-point weights (the default output dtype)."""
        return self.tensor("model.embed_tokens.weight").dtype

    def layer_names(self, layer_idx: int) -> list[str]:
        prefix = f"model.layers.{layer_idx}."
        # Old checkpoints store the rotary `inv_freq` buffer; transformers recomputes it.
        return [n for n in self.names() if n.startswith(prefix) and not n.endswith("rotary_emb.inv_freq")]

    def layer_tensors(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """One decoder layer's tensors, keyed under the layer, with the MLP in LLaMA's layout (the source family's
        `to_llama_layout`): what the construction methods read."""
        prefix = f"model.layers.{layer_idx}."
        tensors = {name[len(prefix) :]: self.tensor(name) for name in self.layer_names(layer_idx)}
        return self.family.to_llama_layout(tensors)

    def check_complete(self) -> None:
        """Every tensor the dense model needs is present (one clear error instead of a failure mid-way)."""
        required = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            required.append("lm_head.weight")
        for i in range(self.config.num_hidden_layers):
            required += self.family.required_tensors(self.config, i)
        names = set(self.names())
        missing = [name for name in required if name not in names]
        if missing:
            raise ValueError(
                f"{self.description} is not a complete {self.family.model_class().__name__} checkpoint: "
                f"{len(missing)} tensors are missing, e.g. {missing[:3]}."
            )

"""A dense model already in memory as a source (`build_moe`): its tensors are read from the model, never copied."""

from pathlib import Path

import torch

from ..source_families import source_family
from .base import DenseSource


class ModelSource(DenseSource):
    """A loaded dense causal LM of a source family (and optionally its tokenizer, for calibration text)."""

    def __init__(self, model, tokenizer=None, path: Path = Path("."), description: str | None = None):
        description = description or f"in-memory {type(model).__name__}"
        source_family(model.config.to_dict(), description)
        super().__init__(path, model.config, description=description)
        self._model = model
        self._tokenizer = tokenizer
        self._state = model.state_dict()

    def names(self) -> list[str]:
        return list(self._state)

    def tensor(self, name: str) -> torch.Tensor:
        return self._state[name].detach()

    def load_model(self, dtype: torch.dtype | None = None, device: str | None = None):
        return self._model  # the caller's model, as it is: never moved or cast

    def load_tokenizer(self):
        if self._tokenizer is None:
            raise ValueError("Calibration text needs a tokenizer: pass tokenizer= (or calibration input_ids=).")
        return self._tokenizer

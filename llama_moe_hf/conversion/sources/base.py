"""A dense source checkpoint: its config, its tensor names, and lazy access to one tensor at a time."""

from pathlib import Path

import torch


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

    tokenizer_source: str | None = None  # --tokenizer: what replaces the checkpoint's own tokenizer (folders only)

    def __init__(self, path: Path, config, hub_id: str | None = None, description: str | None = None):
        self.path = path
        self.config = config
        self.hub_id = hub_id
        self.description = description or str(path)
        self.license = None
        # What `--model` names to open this source again (saved with the recipe): the Hub id, else the full path.
        self.reference = hub_id or str(Path(path).resolve())

    def names(self) -> list[str]:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

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

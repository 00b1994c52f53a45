"""What a merge builds: a base model and N expert models of one source family -> one MoE (`MergeConfig`), and its
YAML file (`merge_recipe.yaml`, saved next to every merged model; `llama-moe merge --config FILE` reads it).

The keys are mergekit-moe's where it has one (`base_model`, `experts: [source_model, positive_prompts,
negative_prompts, noise_scale]`, `shared_experts: [source_model, residual_scale]`, `gate_mode`,
`experts_per_token`, `dtype`, `architecture`); ours add the per-expert `data` and `revision`, `non_ffn`, a split
method per model, the seed and the gate's sizes. A mergekit file is read by `mergekit.py`.
"""

import dataclasses
from pathlib import Path
from typing import Any

from ..conversion.settings import DTYPES, check_choice, check_dtype, check_types

MERGE_RECIPE_FILE = "merge_recipe.yaml"
NON_FFN = ("base", "average")  # where attention, norms and embeddings come from
ARCHITECTURES = ("llama_moe", "mixtral", "qwen2_moe", "qwen3_moe")  # the layout written (the last three: exported)
HIDDEN_TOKENS = ("last", "mean")  # which token of a prompt stands for it in the `hidden` gate


@dataclasses.dataclass(frozen=True)
class ExpertSource:
    """One model whose FFNs become experts (or, under `shared_experts`, the always-on shared expert)."""

    source_model: str | None  # a folder, Hub id or .gguf file (None: the built-in default model)
    positive_prompts: tuple[str, ...] = ()
    negative_prompts: tuple[str, ...] = ()
    noise_scale: float = 0.0  # Gaussian noise on this expert's weights, as a fraction of each weight's std
    residual_scale: float = 1.0  # multiplies the expert's down_proj (mergekit's meaning)
    data: str | None = None  # this expert's text (a file, folder or dataset name): the `expert_data` gate's states
    revision: str | None = None  # Hub revision

    def describe(self) -> str:
        return self.source_model or "the built-in default model"


def setting(default, help: str, choices=None):
    """A merge setting declared once: the recipe key, and the `llama-moe merge` flag of that name with its help."""
    return dataclasses.field(default=default, metadata={"help": help, **({"choices": choices} if choices else {})})


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    """A merge: which models, which gate, what layout. `check()` refuses impossible settings in one line."""

    experts: tuple[ExpertSource, ...]
    base_model: str | None = setting(None, "attention, norms, embeddings (default: the built-in model)")
    base_revision: str | None = setting(None, "Hub revision of the base model")
    shared_experts: tuple[ExpertSource, ...] = ()  # none, or one always-on expert
    gate_mode: str = setting("hidden", "router init: hidden, cheap_embed, expert_data, random, uniform_random, trained")
    experts_per_token: int = setting(2, "top-k")
    dtype: str | None = setting(None, "output weights dtype (default: the base model's)", DTYPES)
    architecture: str = setting("llama_moe", "layout written (the last three: merged, then exported)", ARCHITECTURES)
    non_ffn: str = setting("base", "attention, norms and embeddings: the base's, or averaged over every model", NON_FFN)
    method: str = setting("upcycle", "how each model's FFN becomes experts: upcycle (the whole FFN) or a split method")
    experts_per_model: int = setting(1, "experts each model's FFN is split into (split methods)")
    score_scale_factor: float | None = setting(
        None, "expert output scale (default: 1, or experts_per_model for splits)"
    )
    hidden_token: str = setting(
        "last", "the hidden gate's token of a prompt: its last (mergekit's) or the mean", HIDDEN_TOKENS
    )
    gate_tokens: int = setting(4096, "expert_data gate: tokens of each expert's data")
    gate_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # the gate's own options (`mix_steps`, ...)
    seed: int = setting(0, "seed of random gates and noise")

    @property
    def num_experts(self) -> int:
        return len(self.experts) * self.experts_per_model

    def check(self) -> None:
        check_types(self)
        for expert in (*self.experts, *self.shared_experts):
            check_types(expert)
        check_dtype(self.dtype)
        check_choice("architecture", self.architecture, ARCHITECTURES)
        check_choice("non_ffn", self.non_ffn, NON_FFN)
        check_choice("hidden_token", self.hidden_token, HIDDEN_TOKENS)
        if not self.experts:
            raise ValueError("A merge needs at least one expert model (experts:).")
        if len(self.shared_experts) > 1:
            raise ValueError(f"A merge takes at most one shared expert, got {len(self.shared_experts)}.")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token must be between 1 and the number of experts ({self.num_experts}), "
                f"got {self.experts_per_token}."
            )
        if self.experts_per_model < 1 or self.gate_tokens < 1:
            raise ValueError("experts_per_model and gate_tokens must be at least 1.")
        if self.architecture == "mixtral" and self.shared_experts:
            raise ValueError("architecture mixtral has no shared expert; use qwen2_moe (or qwen3_moe) for one.")

    def to_dict(self) -> dict[str, Any]:
        """The YAML mapping: experts as mappings without their default values."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("experts", "shared_experts"):
            fields[key] = [_expert_dict(e) for e in fields[key]]
        return fields


def _expert_dict(expert: ExpertSource) -> dict[str, Any]:
    defaults = ExpertSource(None)
    return {
        f.name: list(value) if isinstance(value, tuple) else value
        for f in dataclasses.fields(expert)
        if (value := getattr(expert, f.name)) != getattr(defaults, f.name) or f.name == "source_model"
    }


def expert_from_dict(fields: dict, where: str) -> ExpertSource:
    """An `ExpertSource` from a YAML mapping; one ValueError naming an unknown key."""
    if not isinstance(fields, dict) or "source_model" not in fields:
        raise ValueError(f"{where} must be a mapping with a source_model.")
    known = {f.name for f in dataclasses.fields(ExpertSource)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; the keys are {sorted(known)}.")
    values = {k: tuple(v) if k.endswith("_prompts") else v for k, v in fields.items() if v is not None}
    for key in ("positive_prompts", "negative_prompts"):
        if key in fields and isinstance(fields[key], str):
            raise ValueError(f"{where}.{key} must be a list of prompts, not one string.")
    return ExpertSource(**values)


def config_from_dict(fields: dict, where: str = "the merge recipe") -> MergeConfig:
    """A `MergeConfig` from our YAML mapping, checked; one ValueError for an unknown key or a bad value."""
    known = {f.name for f in dataclasses.fields(MergeConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; the keys are {sorted(known)}.")
    values = dict(fields)
    for key in ("experts", "shared_experts"):
        items = values.get(key) or []
        if not isinstance(items, list):
            raise ValueError(f"{where}: {key} must be a list of mappings.")
        values[key] = tuple(expert_from_dict(item, f"{key}[{i}]") for i, item in enumerate(items))
    config = MergeConfig(**values)
    config.check()
    return config


def save_merge_recipe(path: str | Path, config: MergeConfig) -> Path:
    from ..conversion.recipe import to_yaml

    path = Path(path)
    path.write_text(
        "# llama-moe-hf merge recipe: what was merged (docs/merging.md).\n"
        "# Merge again: llama-moe merge --config merge_recipe.yaml --output DIR\n" + to_yaml(config.to_dict()),
        encoding="utf-8",
    )
    return path


def read_yaml(path: str | Path) -> dict:
    """The mapping of a merge recipe or mergekit-moe file (one ValueError naming the file, and line, otherwise)."""
    from ..parsing import read_config

    return read_config(str(path))


__all__ = ["DTYPES", "MERGE_RECIPE_FILE", "ExpertSource", "MergeConfig", "config_from_dict", "save_merge_recipe"]

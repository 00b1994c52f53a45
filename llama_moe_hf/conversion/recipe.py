"""Conversion recipes: what to build (`MoERecipe`) apart from how to run it (`RunOptions`), and their YAML files.

A recipe file is flat YAML whose keys are the `llama-moe convert` flags (`num_experts: 8` is `--num-experts 8`), so
`llama-moe convert --config recipe.yaml` reads it and flags override it (TRL's `TrlParser`). Every output folder
carries the recipe it was built from (`moe_recipe.yaml`), with the run settings that decide the output's bytes, so
converting again from that file rebuilds the same safetensors:

    llama-moe convert --config smollm2-moe/moe_recipe.yaml --output smollm2-moe-again

`MoERecipe.options` holds the settings of the chosen components (`cluster_on`, `selector_steps`, `attn_experts`,
...): which component accepts which option is in the registries (`registry.py`). Validation and defaults are in one
place, `plan.resolve_recipe`; nothing here changes a recipe it is given (they are frozen).
"""

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from ..source_families import SOURCE_FAMILIES
from . import components  # noqa: F401  (registers the built-in components)
from .recipe_fields import RecipeFields
from .registry import option_owner

RECIPE_FILE = "moe_recipe.yaml"
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class MoERecipe(RecipeFields):
    """What to build: family, method, experts, top-k, shared experts, rescaling, router and its initialisation,
    compensation, calibration data and sizes, seed, and the chosen components' `options`."""

    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "MoERecipe":
        """A recipe from flat keys (recipe fields and component options), as in a recipe file."""
        recipe, run = split_fields(fields)
        if run:
            raise ValueError(f"{', '.join(run)} are run options, not recipe fields.")
        return cls(**recipe)

    def with_fields(self, fields: dict[str, Any]) -> tuple["MoERecipe", dict[str, Any]]:
        """(this recipe with the flat `fields` that are recipe fields or options set, the run options among them)."""
        recipe_fields, run_fields = split_fields(dict(fields))
        options = {**self.options, **recipe_fields.pop("options")}
        return dataclasses.replace(self, **recipe_fields, options=options), run_fields

    def to_dict(self) -> dict[str, Any]:
        """Flat keys: the recipe fields, then the component options."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(RecipeFields)}
        return {**fields, **self.options}


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How to run a conversion: source and output paths, dtype, device, card and Hub settings."""

    model: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "local folder, Hub repo id or .gguf file of a dense model of the source families "
            f"{', '.join(SOURCE_FAMILIES)} (default: SmolLM2-135M-Instruct)"
        },
    )
    tokenizer: str | None = dataclasses.field(
        default=None, metadata={"help": "tokenizer folder or Hub id, for a --model without one (default: --model's)"}
    )
    output: str | None = dataclasses.field(default=None, metadata={"help": "output folder (must not exist)"})
    overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "replace an existing output folder at the end"}
    )
    dtype: str | None = dataclasses.field(
        default=None, metadata={"help": "output weights dtype (default: the source's)", "choices": DTYPES}
    )
    max_shard_size: str = dataclasses.field(default="5GB", metadata={"help": "largest safetensors shard"})
    device: str | None = dataclasses.field(
        default=None, metadata={"help": "device of the calibration passes (default: cuda if available, else cpu)"}
    )
    calibration_batch_size: int = dataclasses.field(default=4, metadata={"help": "sequences per calibration pass"})
    save_split: str | None = dataclasses.field(
        default=None, metadata={"help": "write the calibrated split and routers to this .safetensors file"}
    )
    load_split: str | None = dataclasses.field(
        default=None, metadata={"help": "reuse a split file written by --save-split instead of calibrating"}
    )
    revision: str | None = dataclasses.field(default=None, metadata={"help": "Hub revision of --model"})
    token: str | None = dataclasses.field(default=None, metadata={"help": "Hugging Face token (default: logged-in)"})
    allow_pickle: bool = dataclasses.field(
        default=False, metadata={"help": "accept pickled pytorch_model.bin sources (runs pickle code)"}
    )
    base_model: str | None = dataclasses.field(
        default=None, metadata={"help": "Hub id of the source for the model card (automatic for Hub sources)"}
    )
    license: str | None = dataclasses.field(
        default=None, metadata={"help": "model card license (default: the source's, if its README.md says)"}
    )
    repo_id: str | None = dataclasses.field(
        default=None, metadata={"help": "Hub repository ORG/NAME (also used in the model card's snippets)"}
    )
    push_to_hub: bool = dataclasses.field(default=False, metadata={"help": "upload the result to --repo-id"})
    private: bool = dataclasses.field(default=False, metadata={"help": "create the Hub repository as private"})
    progress: bool = dataclasses.field(default=True, metadata={"help": "show progress bars"})
    eval: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "after writing, report the result's perplexity next to the dense model's on held-out built-in "
            "text (a few seconds; skipped above 1.5B parameters)"
        },
    )


# Run options that decide the bytes of the output: saved with the recipe so that it rebuilds the same files.
REPRODUCING_RUN_OPTIONS = ("model", "revision", "dtype", "max_shard_size")


def split_fields(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat keys -> (MoERecipe keyword arguments with `options`, RunOptions keyword arguments). Unknown keys: one
    ValueError naming them."""
    recipe_names = {f.name for f in dataclasses.fields(RecipeFields)}
    run_names = {f.name for f in dataclasses.fields(RunOptions)}
    recipe, run, options, unknown = {}, {}, dict(fields.pop("options", None) or {}), []
    for key, value in fields.items():
        if key in recipe_names:
            recipe[key] = value
        elif key in run_names:
            run[key] = value
        elif option_owner(key) is not None:
            options[key] = value
        else:
            unknown.append(key)
    unknown += [key for key in options if option_owner(key) is None]
    if unknown:
        raise ValueError(f"Unknown recipe keys {sorted(unknown)}; see `llama-moe convert --help` for the valid ones.")
    return {**recipe, "options": options}, run


def check_types(instance) -> None:
    """One ValueError for a field whose value does not have the annotated type (recipes come from YAML and
    keyword arguments, which argparse does not check). Integers are accepted where floats are expected."""
    hints = typing.get_type_hints(type(instance))
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if not _has_type(value, hints[field.name]):
            raise ValueError(f"{field.name} must be {_type_name(hints[field.name])}, got {value!r}.")


def _has_type(value, annotation) -> bool:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in args)
    if annotation is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_has_type(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _type_name(annotation) -> str:
    return str(annotation).replace("typing.", "").replace("NoneType", "None")


def to_yaml(fields: dict[str, Any]) -> str:
    """Flat recipe keys as YAML, in order."""
    import yaml

    return yaml.safe_dump(fields, sort_keys=False, width=120) if fields else ""


def save_recipe(path: str | Path, recipe: MoERecipe, run: RunOptions | None = None) -> Path:
    """Write `recipe` (and the run options that decide the output's bytes) as a flat YAML recipe file."""
    core = {k: v for k, v in recipe.to_dict().items() if k not in recipe.options}
    sections = [
        "# llama-moe-hf conversion recipe: what was built (docs/cli.md).\n"
        "# Build it again: llama-moe convert --config moe_recipe.yaml --output DIR\n" + to_yaml(core)
    ]
    if recipe.options:
        sections.append("# Options of the family, methods and router initialisations used:\n" + to_yaml(recipe.options))
    if run is not None:
        run_fields = {name: getattr(run, name) for name in REPRODUCING_RUN_OPTIONS}
        if run.tokenizer:  # one other than the model's own (which the calibration tokens came from)
            run_fields["tokenizer"] = run.tokenizer
        sections.append("# How it was run (the settings that decide the output's bytes):\n" + to_yaml(run_fields))
    path = Path(path)
    path.write_text("".join(sections), encoding="utf-8")
    return path


def load_recipe(path: str | Path) -> tuple[MoERecipe, dict[str, Any]]:
    """A recipe file -> (the recipe, the run options it sets)."""
    import yaml

    path = Path(path)
    try:
        fields = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"Cannot read the recipe file {path}: {error}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"The recipe file {path} must hold a YAML mapping of settings.")
    recipe, run = split_fields(fields)
    return MoERecipe(**recipe), run

"""Conversion recipes: what to build (`MoERecipe`) apart from how to run it (`RunOptions`), and their YAML files.

A recipe file is flat YAML whose keys are the `llama-moe convert` flags (`num_experts: 8` is `--num-experts 8`), so
`llama-moe convert --config recipe.yaml` reads it and flags override it (TRL's `TrlParser`). Every output folder
carries the recipe it was built from (`moe_recipe.yaml`), with the run settings that decide the output's bytes, so
converting again from that file rebuilds the same safetensors:

    llama-moe convert --config smollm2-moe/moe_recipe.yaml --output smollm2-moe-again

`MoERecipe.options` holds the settings of the chosen components (`cluster_on`, `selector_steps`, `attn_experts`,
...): which component accepts which option is in the registries (`registry.py`). The settings and their checks are
declared in `settings.py`, their defaults filled by `plan.resolve_recipe`; recipes are frozen.

Named presets are recipe files too: `recipes/convert/NAME.yaml` (`llama-moe convert --preset NAME`). The files are
the only copy of each preset's settings, so `--preset g-moefication` and `--config recipes/convert/g-moefication.yaml`
are the same conversion: an installed package carries them as `llama_moe/presets/` (setup.py maps the folder
there), an editable install reads the clone's `recipes/convert/`. A file's leading comment lines, up to its example
command, are the preset's description in `llama-moe convert --help`.
"""

import dataclasses
from pathlib import Path
from typing import Any

from . import components  # noqa: F401  (registers the built-in components)
from .registry import option_owner
from .settings import RecipeFields, RunOptions

RECIPE_FILE = "moe_recipe.yaml"


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


_PACKAGE = Path(__file__).resolve().parents[1]
PRESETS_DIR = _PACKAGE / "presets" if (_PACKAGE / "presets").is_dir() else _PACKAGE.parent / "recipes" / "convert"
# G-MoEfication's training-free conversion, named in `--help` (benchmarks/reports/gmoefication.md, "How each default
# was chosen").
BEST_PRESET = "g-moefication"


def preset_names() -> list[str]:
    """The presets there are, sorted (none when the package runs without its clone's `recipes/` folder)."""
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def sparsity_presets() -> list[str]:
    """`sparse-N`: the best measured recipe with N% of the FFN neurons active per token, by increasing N."""
    names = [name for name in preset_names() if name.startswith("sparse-") and name[7:].isdigit()]
    return sorted(names, key=lambda name: int(name[7:]))


def preset_path(name: str) -> Path:
    """The recipe file of preset `name`; one ValueError naming the presets for an unknown name."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(preset_names()) or f"none: {PRESETS_DIR} is missing"
        raise ValueError(f"Unknown preset {name!r}; the presets are: {known}.")
    return path


# The presets' measured quality and speed (benchmarks/quality/presets.py and the speed benchmarks write it).
PRESET_RESULTS = _PACKAGE.parent / "benchmarks" / "results" / "presets.jsonl"


def preset_measurements(path: Path | None = None) -> dict[str, str]:
    """{preset: one line of its latest measured figures}: perplexity as a ratio to the dense model per held-out text,
    the conversion's minutes, decoding speed against dense per runtime, and task accuracy as a share of the dense
    model's; {} without the results file. Rows of folders calibrated on other text than the preset's own (a variant,
    or the preset before its calibration data changed) are left out; speed rows time the layout and always count."""
    import json

    from ..text.corpus import DEFAULT_DESCRIPTION

    path = path or PRESET_RESULTS
    if not path.is_file():
        return {}
    latest: dict[tuple, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        calibration = row.get("calibration", DEFAULT_DESCRIPTION)  # rows before the field: the default text
        if row["kind"] != "speed" and not calibration.startswith(_calibration_prefix(row["preset"])):
            continue
        latest[(row["preset"], row["kind"], row.get("runtime"))] = row  # later lines win
    parts: dict[str, list[str]] = {}
    for (preset, kind, runtime), row in sorted(latest.items(), key=lambda item: str(item[0])):
        if kind == "quality":
            ratios = ", ".join(f"{text} {ratio:.2f}x" for text, ratio in row["ratio"].items())
            minutes = f"; converted in {row['convert_seconds'] / 60:.0f} min" if row.get("convert_seconds") else ""
            parts.setdefault(preset, []).insert(0, f"perplexity vs dense: {ratios}{minutes}")
        elif kind == "tasks":
            shares = ", ".join(f"{task} {share:.0%}" for task, share in row["share"].items())
            parts.setdefault(preset, []).append(f"task accuracy vs dense: {shares}")
        elif "decode_ratio" in row:
            parts.setdefault(preset, []).append(f"decodes {row['decode_ratio']:.2f}x dense ({runtime})")
    return {preset: "; ".join(texts) for preset, texts in parts.items()}


def _calibration_prefix(preset: str) -> str:
    """How the description of the preset's calibration text begins (`conversion_info["calibration_data"]`)."""
    import yaml

    from ..text.corpus import DEFAULT_DESCRIPTION

    path = preset_path(preset) if preset in preset_names() else None
    spec = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("calibration_data") if path else None
    if spec is None:
        return DEFAULT_DESCRIPTION
    return f"built-in corpus {spec.removeprefix('builtin:')}" if spec.startswith("builtin:") else ""


def preset_description(name: str) -> str:
    """The leading comment lines of the preset's file, up to its example command, as one paragraph."""
    lines = []
    for line in preset_path(name).read_text(encoding="utf-8").splitlines():
        text = line.removeprefix("#").strip()
        if not line.startswith("#") or text.startswith("llama-moe "):
            break
        lines.append(text)
    return " ".join(lines)

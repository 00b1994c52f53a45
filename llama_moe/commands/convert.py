"""`llama-moe convert`: its flags are the recipe's fields, the registered components' options and the run options."""

import dataclasses
import textwrap

from ..conversion.recipe import (
    BEST_PRESET,
    MoERecipe,
    preset_description,
    preset_measurements,
    preset_names,
    preset_path,
    sparsity_presets,
)
from ..conversion.registry import FAMILIES, METHODS, REGISTRIES, ROUTER_INITS, option_fields
from ..conversion.settings import ROUTER_TYPES, RecipeFields, RunOptions
from ..source_families import SOURCE_FAMILIES


def flag_choices() -> dict[str, list[str]]:
    """The registered names each component flag accepts: for every target of every family, the methods that build
    it, the router initialisations that can start its routers, and the gates."""
    choices = {"family": list(FAMILIES)}
    for family in (FAMILIES[name] for name in FAMILIES):
        for kind, part in family.parts.items():
            flags = part.fields()
            choices[flags["method"]] = [name for name, method in METHODS.items() if method.target == kind]
            choices[flags["router_init"]] = [name for name, init in ROUTER_INITS.items() if kind in init.targets]
            if "router_type" in flags:  # SoapMoE's experts have no gate type
                choices[flags["router_type"]] = list(ROUTER_TYPES)
    return choices


def option_classes() -> list[type]:
    """Each registered component's options dataclass, titled for `--help`."""
    classes = []
    for registry in REGISTRIES:
        for name, component in registry.items():
            if option_fields(component):
                component.Options._argument_group_name = f"options of {registry.kind} {name!r}"
                classes.append(component.Options)
    return classes


USAGE = """%(prog)s [--preset NAME | --config FILE] [--model MODEL] [--output OUTPUT]
                         [--num-experts NUM_EXPERTS] [--top-k TOP_K] [OPTION ...]"""


def register(subparsers) -> None:
    RecipeFields._argument_group_name = "what to build (recipe fields)"
    RunOptions._argument_group_name = "how to run"
    parser = subparsers.add_parser(
        "convert",
        help="convert a dense LLaMA-like checkpoint into an MoE checkpoint",
        usage=USAGE,
        description="Convert a dense checkpoint (source families: "
        f"{', '.join(SOURCE_FAMILIES)}) into an MoE checkpoint folder, streaming one layer at a time. "
        "--preset NAME or --config FILE reads a recipe file (flat YAML of these flags); flags given as well override "
        "it.\n\nWhich preset: to serve a faster model, by the share of the FFN active per token (what sets the "
        f"speed), --preset {' / '.join(sparsity_presets())} (healed; they export to vLLM, SGLang and llama.cpp). "
        f"For G-MoEfication's conversion, with no healing, in minutes, use --preset {BEST_PRESET}. To start a model "
        "for training: llama-moe-v1, llama-moe-v2-residual, upcycle.\n\n" + presets_text(),
        epilog=presets_text(full=True) + "\n\n" + components_text(),
        dataclass_types=[RecipeFields, *option_classes(), RunOptions],
    )
    parser.add_argument(
        "--preset",
        choices=preset_names(),
        help="a named recipe of recipes/convert/ (listed above), like --config with its file",
    )
    choices = flag_choices()
    for action in parser._actions:
        if action.dest in choices and action.choices is None:  # a component may narrow its own flag's choices
            action.choices = choices[action.dest]


def help_entry(name: str, description: str, column: int) -> str:
    """One `--help` epilog entry: the name in a column of `column` characters, the description wrapped beside it."""
    return textwrap.fill(description, 110, initial_indent=f"  {name:{column}} ", subsequent_indent=" " * (column + 3))


# What each preset gives and when to pick it, in the order the top of `--help` lists them (the figures come from the
# results file; the full entries, from the recipe files' comments, close the help). Presets not listed follow, with
# their description's first sentence.
PRESET_PICKS = {
    "sparse-25": "25% of the FFN active (layer 0 dense), healed, exports to Qwen2-MoE (vLLM, SGLang) and GGUF (llama.cpp): the "
    "fastest, the furthest from dense; to decode fast, or to train on.",
    "sparse-50": "50% active, healed, exports likewise: speed and quality between the other two.",
    "sparse-75": "75% active, healed, exports likewise: keeps the most of the dense model.",
    "g-moefication": "G-MoEfication's recipe (activation clusters, selector, compensation): 6 of 8 experts, no "
    "healing, 3 min, transformers only; the healed sparse-75 keeps more.",
    "llama-moe-v1": "LLaMA-MoE v1: 8 random experts, top-2, unusable until trained: the start for continual "
    "pre-training.",
    "llama-moe-v2-residual": "LLaMA-MoE v2's residual split (1 shared + top-1 of 7, k-means router): a start for "
    "training or `llama-moe heal`.",
    "llama-moe-v2-attention": "LLaMA-MoE v2's attention experts beside a random MLP MoE: a start for training.",
    "upcycle": "sparse upcycling: every expert a copy of the dense FFN, exactly the dense model until trained.",
    "sparse-25-selector": "sparse-25 with the selector router and compensation, which no export takes: to compare.",
    "sparse-50-selector": "sparse-50 likewise.",
    "sparse-75-selector": "sparse-75 likewise.",
}
PICK_RUNTIMES = {"transformers eager, cpu float32": "transformers eager", "llama.cpp F16": "llama.cpp F16"}


def preset_speeds() -> dict[str, dict[str, float]]:
    """{preset: {runtime: decode ratio}}: the latest speed row of each preset and runtime in the results file, the
    rule `preset_measurements` and benchmarks/tables.py's `preset_speed` table quote them by."""
    import json

    from ..conversion import recipe

    speeds: dict[str, dict[str, float]] = {}
    path = recipe.PRESET_RESULTS
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        row = json.loads(line)
        if row.get("kind") == "speed" and "decode_ratio" in row:
            speeds.setdefault(row["preset"], {})[row["runtime"]] = row["decode_ratio"]
    return speeds


def _keeps_first_layer_dense(name: str) -> bool:
    """Whether the preset keeps layer 0 dense, which its recorded decoding speeds (timed before) did not."""
    import yaml

    from ..conversion.recipe import preset_path

    return (yaml.safe_load(preset_path(name).read_text(encoding="utf-8")) or {}).get("moe_layers") == "every:1:1"


def presets_text(full: bool = False) -> str:
    """The presets for `--help`: what each gives and when to pick it, with its latest decoding speed (the top of the
    help), or `full`: each recipe file's description and its latest measured figures (the end of it)."""
    if not full:
        names = [name for name in PRESET_PICKS if name in preset_names()]
        names += [name for name in preset_names() if name not in PRESET_PICKS]
        column, speeds = max(map(len, names), default=0) + 1, preset_speeds()
        lines = ["presets (measured on SmolLM2-135M-Instruct: docs/quality.md; in full below):"]
        for name in names:
            measured = speeds.get(name, {})
            rates = [
                f"{measured[runtime]:.2f}x ({where})" for runtime, where in PICK_RUNTIMES.items() if runtime in measured
            ]
            pick = PRESET_PICKS.get(name) or preset_description(name).split(". ")[0] + "."
            layout = " (timed with layer 0 MoE too)" if _keeps_first_layer_dense(name) else ""
            speed = f" Decodes {', '.join(rates)} as fast as dense{layout}." if rates else ""
            lines.append(help_entry(name, pick + speed, column))
        return "\n".join(lines)
    lines = ["presets in full (--preset NAME; the files are recipes/convert/NAME.yaml):"]
    measured = preset_measurements()
    for name in preset_names():
        figures = f" Measured (benchmarks/results/presets.jsonl): {measured[name]}." if name in measured else ""
        lines.append(help_entry(name, preset_description(name) + figures, 24))
    return "\n".join(lines)


def expand_preset(argv: list[str]) -> list[str]:
    """`convert ... --preset NAME ...` as `convert ... --config FILE ...`, so that flags override a preset exactly as
    they override a recipe file. An unknown name is left to the parser, whose one-line error lists the presets."""
    index = next((i for i, arg in enumerate(argv) if arg == "--preset" or arg.startswith("--preset=")), None)
    if index is None:
        return argv
    name, end = argv[index].partition("=")[2], index + 1
    if argv[index] == "--preset":
        name, end = (argv[index + 1] if index + 1 < len(argv) else ""), index + 2
    if name not in preset_names():
        return argv
    if any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        raise ValueError("--preset and --config both name a recipe file; give one of them.")
    return [*argv[:index], "--config", str(preset_path(name)), *argv[end:]]


def components_text() -> str:
    """The registered components and their descriptions, for `--help`."""
    lines = []
    for registry in [SOURCE_FAMILIES, *REGISTRIES]:
        lines.append(f"{registry.plural}:")
        lines.extend(help_entry(name, component.description, 16) for name, component in registry.items())
    return "\n".join(lines)


def recipe_and_run(args) -> tuple[MoERecipe, RunOptions]:
    """The recipe and run options of parsed flags: a component's option is in the recipe when the command line or
    the recipe file sets it, whatever its value (as the Python API takes what it is given)."""
    values = vars(args)
    recipe = {f.name: values[f.name] for f in dataclasses.fields(RecipeFields)}
    given = values.get("given", frozenset())
    options = {
        f.name: values[f.name]
        for options_class in option_classes()
        for f in dataclasses.fields(options_class)
        if f.name in given
    }
    run = RunOptions(**{f.name: values[f.name] for f in dataclasses.fields(RunOptions)})
    return MoERecipe(**recipe, options=options), run


def run(args) -> None:
    from ..conversion.pipeline import convert
    from ..export.card import serving_section

    recipe, run_options = recipe_and_run(args)
    result = convert(recipe, run_options, card_sections=serving_section)
    print(f"wrote {result.output_dir}")
    print(parameters_text(result.total_parameters, result.active_parameters))
    if result.pushed:
        print(f"pushed: {result.pushed}")


def parameters_text(total: int, active: int) -> str:
    return f"total parameters: {total:,}\nactive parameters per token: {active:,} ({100 * active / total:.1f}%)"

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


def register(subparsers) -> None:
    RecipeFields._argument_group_name = "what to build (recipe fields)"
    RunOptions._argument_group_name = "how to run"
    parser = subparsers.add_parser(
        "convert",
        help="convert a dense LLaMA-like checkpoint into an MoE checkpoint",
        description="Convert a dense checkpoint (source families: "
        f"{', '.join(SOURCE_FAMILIES)}) into an MoE checkpoint folder, streaming one layer at a time. "
        "--preset NAME or --config FILE reads a recipe file (flat YAML of these flags); flags given as well override "
        f"it. For the best conversion without training measured so far, use --preset {BEST_PRESET}; for a given "
        f"share of the FFN active per token (what sets the speed), --preset {' / '.join(sparsity_presets())} (each "
        "the best measured at its sparsity, healed: docs/quality.md).",
        epilog=presets_text() + "\n\n" + components_text(),
        dataclass_types=[RecipeFields, *option_classes(), RunOptions],
    )
    parser.add_argument(
        "--preset",
        choices=preset_names(),
        help=f"a named recipe of recipes/convert/ (listed below), like --config with its file; {BEST_PRESET} is the "
        "best measured conversion without training",
    )
    choices = flag_choices()
    for action in parser._actions:
        if action.dest in choices and action.choices is None:  # a component may narrow its own flag's choices
            action.choices = choices[action.dest]


def help_entry(name: str, description: str, column: int) -> str:
    """One `--help` epilog entry: the name in a column of `column` characters, the description wrapped beside it."""
    return textwrap.fill(description, 110, initial_indent=f"  {name:{column}} ", subsequent_indent=" " * (column + 3))


def presets_text() -> str:
    """The presets and their descriptions, for `--help`."""
    lines = ["presets (--preset NAME; the files are recipes/convert/NAME.yaml):"]
    measured = preset_measurements()
    for name in preset_names():
        best = " [the measured best without training]" if name == BEST_PRESET else ""
        figures = f" Measured (benchmarks/results/presets.jsonl): {measured[name]}." if name in measured else ""
        lines.append(help_entry(name, preset_description(name) + best + figures, 24))
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
    values = vars(args)
    recipe = {f.name: values[f.name] for f in dataclasses.fields(RecipeFields)}
    options = {
        f.name: values[f.name]
        for options_class in option_classes()
        for f in dataclasses.fields(options_class)
        if values[f.name] != f.default
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

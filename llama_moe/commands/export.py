"""`llama-moe export MODEL --to TARGET --output DIR`: its flags are `ExportOptions` and the targets' options."""

from ..export import TARGETS, ExportOptions, export_model
from ..registry import option_fields


def option_classes() -> list[type]:
    """Each registered target's options dataclass, titled for `--help`."""
    classes = []
    for name, target in TARGETS.items():
        if option_fields(target):
            target.Options._argument_group_name = f"options of export target {name!r}"
            classes.append(target.Options)
    return classes


def register(subparsers) -> None:
    ExportOptions._argument_group_name = "how to export"
    parser = subparsers.add_parser(
        "export",
        help="export a converted model exactly to transformers' Mixtral, Qwen2-MoE or Qwen3-MoE, or to llama.cpp's GGUF; or average its experts back into a dense model",
        description="Export a converted model folder exactly into another MoE format, streaming tensor by tensor "
        "into an atomic output folder. What the target cannot express exactly is refused (exit status 2) and "
        "nothing is written.",
        epilog=targets_text(),
        dataclass_types=[ExportOptions, *option_classes()],
    )
    parser.add_argument(
        "model", help="converted model folder (written by llama-moe convert), or `default` (the built-in dense model)"
    )
    for action in parser._actions:
        if action.dest == "to":
            action.choices = list(TARGETS)


def targets_text() -> str:
    import textwrap

    lines = ["export targets:"]
    for name, target in TARGETS.items():
        lines.append(textwrap.fill(target.description, 110, initial_indent=f"  {name:12} ", subsequent_indent=" " * 15))
    return "\n".join(lines)


def target_options(args) -> dict:
    """The chosen target's options; another target's option set away from its default is a mistake, not ignored."""
    values, chosen = vars(args), TARGETS[args.to]
    options = {}
    for name, target in TARGETS.items():
        for field in option_fields(target):
            if target is chosen:
                options[field.name] = values[field.name]
            elif values[field.name] != field.default:
                flag = "--" + field.name.replace("_", "-")
                raise ValueError(f"{flag} is an option of export target {name!r}, not of {args.to!r}.")
    return options


def run(args) -> None:
    result = export_model(
        args.model,
        args.to,
        args.output,
        overwrite=args.overwrite,
        dtype=args.dtype,
        progress=args.progress,
        eval=args.eval,
        **target_options(args),
    )
    for note in result.notes:
        print(f"note: {note}")
    print(f"wrote {result.output_dir} ({result.target}: {', '.join(result.files)})")

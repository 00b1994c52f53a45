"""`llama-moe merge`: a base model and expert models -> one MoE (`--config FILE`, our merge recipe or mergekit-moe's
YAML as it is, or flags), and `--add-expert MODEL --into MOE`. Flags override the file's top-level keys."""

import dataclasses

from ..conversion.settings import RunOptions
from ..merging.config import MergeConfig

FILE_ONLY = ("experts", "shared_experts", "gate_options")  # mappings: the --config file's (or the flags below)


@dataclasses.dataclass(frozen=True)
class ModelFlags:
    """The models as flags, for a merge without a --config file (or over its lists)."""

    experts: list[str] | None = dataclasses.field(
        default=None,
        metadata={"help": "expert models, one routed expert each (folders, Hub ids, .gguf files)", "nargs": "+"},
    )
    shared_expert: str | None = dataclasses.field(
        default=None, metadata={"help": "a model whose FFN is an always-on shared expert"}
    )
    residual_scale: float | None = dataclasses.field(
        default=None, metadata={"help": "the shared expert's down_proj scale (mergekit's residual_scale)"}
    )


def declared_flags(name: str, declaration, names, required=()) -> type:
    """A dataclass of `declaration`'s fields `names` as they are declared there (type, default, help, choices): the
    flags of a command that take its settings, declared once. `required`: flags this command cannot do without."""
    fields = {f.name: f for f in dataclasses.fields(declaration)}

    def copied(n):
        default = {} if n in required else {"default": fields[n].default}
        return n, fields[n].type, dataclasses.field(**default, metadata=fields[n].metadata)

    return dataclasses.make_dataclass(name, [copied(n) for n in names], frozen=True)


MERGE_SETTINGS = [f.name for f in dataclasses.fields(MergeConfig) if f.name not in FILE_ONLY]
MergeFlags = declared_flags("MergeFlags", MergeConfig, MERGE_SETTINGS)  # each overrides the --config file's key
RUN_SETTINGS = (
    "output",
    "overwrite",
    "device",
    "offload_dir",
    "max_shard_size",
    "eval",
    "progress",
    "token",
    "allow_pickle",
    "force",
)
MergeRun = declared_flags("MergeRun", RunOptions, RUN_SETTINGS, required=("output",))


@dataclasses.dataclass(frozen=True)
class AddExpertFlags:
    """`--add-expert MODEL --into MOE`: one more expert in a merged model."""

    add_expert: str | None = dataclasses.field(default=None, metadata={"help": "the model whose FFN is added"})
    into: str | None = dataclasses.field(default=None, metadata={"help": "the merged MoE folder it is added to"})
    positive_prompts: list[str] | None = dataclasses.field(
        default=None,
        metadata={"help": "prompts of the new expert (its gate row, as the merge's gate made it)", "nargs": "+"},
    )
    negative_prompts: list[str] | None = dataclasses.field(
        default=None, metadata={"help": "prompts the new expert should not get", "nargs": "+"}
    )
    data: str | None = dataclasses.field(default=None, metadata={"help": "the new expert's text (expert_data gate)"})


def register(subparsers) -> None:
    groups = ((ModelFlags, "the models"), (MergeFlags, "what to merge"), (AddExpertFlags, "adding an expert"))
    for group, title in (*groups, (MergeRun, "how to run")):
        group._argument_group_name = title
    parser = subparsers.add_parser(
        "merge",
        help="build one MoE from several dense models of one family (mergekit-moe's job), or add an expert to one",
        description="Merge a base model and expert models of one source family into one MoE: each expert model's "
        "FFN becomes a routed expert (or several, with a split --method), attention, norms and embeddings come from "
        "the base (or their average), the router starts from the experts' prompts or data (--gate-mode). --config "
        "reads our merge recipe or a mergekit-moe YAML file as it is; flags override its keys. Models of other "
        "families or shapes, missing prompts, unknown gate modes or unsupported mergekit keys end with one error "
        "line and nothing written.",
        dataclass_types=[ModelFlags, MergeFlags, AddExpertFlags, MergeRun],
    )
    parser.own_config = True
    config = next(a for a in parser._actions if a.dest == "config")
    config.default, config.help = None, "merge recipe or mergekit-moe YAML file (docs/merging.md)"


def merge_config(args):
    """The `MergeConfig` of the --config file with the flags over it."""
    from ..merging.config import config_from_dict, read_yaml
    from ..merging.mergekit import from_mergekit

    fields = from_mergekit(read_yaml(args.config), args.config) if args.config else {}
    fields |= {name: getattr(args, name) for name in MERGE_SETTINGS if name in args.given}
    if args.experts:
        fields["experts"] = [{"source_model": model} for model in args.experts]
    if args.shared_expert:
        fields["shared_experts"] = [{"source_model": args.shared_expert}]
    if args.residual_scale is not None:
        if not fields.get("shared_experts"):
            raise ValueError("--residual-scale scales the shared expert: give --shared-expert (or shared_experts:).")
        fields["shared_experts"] = [{**fields["shared_experts"][0], "residual_scale": args.residual_scale}]
    if "experts" not in fields:
        raise ValueError("Name the expert models: --experts MODEL ... or --config FILE.")
    return config_from_dict(fields, args.config or "the flags")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_expert(args, run_options):
    """`--add-expert MODEL --into MOE`: the merge's settings come from MOE's recipe, so merge flags are refused."""
    from ..merging.add_expert import add_expert

    if not (args.add_expert and args.into):
        raise ValueError("Adding an expert needs both --add-expert MODEL and --into MERGED_MOE.")
    names = ["config", *(f.name for f in dataclasses.fields(ModelFlags)), *MERGE_SETTINGS]
    given = [flag(name) for name in names if name in args.given]
    if given:
        raise ValueError(
            f"--add-expert takes the merge's settings from MOE's merge_recipe.yaml: drop {', '.join(given)}."
        )
    return add_expert(
        args.into,
        args.add_expert,
        run_options.output,
        positive_prompts=tuple(args.positive_prompts or ()),
        negative_prompts=tuple(args.negative_prompts or ()),
        data=args.data,
        run=run_options,
    )


def run(args) -> None:
    from .convert import parameters_text

    run_options = RunOptions(**{name: getattr(args, name) for name in RUN_SETTINGS})
    if args.add_expert or args.into:
        result = add_expert(args, run_options)
    else:
        from ..merging.pipeline import merge

        given = [flag(f.name) for f in dataclasses.fields(AddExpertFlags) if f.name in args.given]
        if given:
            raise ValueError(f"{', '.join(given)} describe the expert --add-expert adds: give --add-expert and --into.")
        result = merge(merge_config(args), run_options)
    print(f"wrote {result.output_dir}")
    print(parameters_text(result.total_parameters, result.active_parameters))

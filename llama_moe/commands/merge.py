"""`llama-moe merge`: a base model and expert models -> one MoE (`--config FILE`, our merge recipe or mergekit-moe's
YAML as it is, or flags), and `--add-expert MODEL --into MOE`. Flags override the file's top-level keys."""

import dataclasses

from ..conversion.settings import DTYPES


@dataclasses.dataclass(frozen=True)
class MergeFlags:
    """What to merge, as flags (each overrides the --config file's key of the same name)."""

    base_model: str | None = dataclasses.field(
        default=None, metadata={"help": "attention, norms, embeddings (default: the file's; else the built-in model)"}
    )
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
    gate_mode: str | None = dataclasses.field(default=None, metadata={"help": "router init (default: hidden)"})
    experts_per_token: int | None = dataclasses.field(default=None, metadata={"help": "top-k (default: 2)"})
    architecture: str | None = dataclasses.field(
        default=None, metadata={"help": "layout written: llama_moe (default), mixtral, qwen2_moe, qwen3_moe"}
    )
    non_ffn: str | None = dataclasses.field(default=None, metadata={"help": "base (default) or average"})
    method: str | None = dataclasses.field(
        default=None, metadata={"help": "how each model's FFN becomes experts (default: upcycle, the whole FFN)"}
    )
    experts_per_model: int | None = dataclasses.field(default=None, metadata={"help": "experts per model (splits)"})
    dtype: str | None = dataclasses.field(default=None, metadata={"help": "output weights dtype", "choices": DTYPES})
    seed: int | None = dataclasses.field(default=None, metadata={"help": "seed of random gates and noise"})


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


@dataclasses.dataclass(frozen=True)
class MergeRun:
    output: str = dataclasses.field(metadata={"help": "output folder (must not exist, unless --overwrite)"})
    overwrite: bool = dataclasses.field(default=False, metadata={"help": "replace an existing output folder"})
    device: str | None = dataclasses.field(default=None, metadata={"help": "device of the gate's passes"})
    max_shard_size: str = dataclasses.field(default="5GB", metadata={"help": "largest safetensors shard"})
    eval: bool = dataclasses.field(default=True, metadata={"help": "report perplexity next to the base model's"})
    progress: bool = dataclasses.field(default=True, metadata={"help": "show progress bars"})
    token: str | None = dataclasses.field(default=None, metadata={"help": "Hugging Face token"})
    allow_pickle: bool = dataclasses.field(default=False, metadata={"help": "accept pickled .bin sources"})


def register(subparsers) -> None:
    for group, title in ((MergeFlags, "what to merge"), (AddExpertFlags, "adding an expert"), (MergeRun, "how to run")):
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
        dataclass_types=[MergeFlags, AddExpertFlags, MergeRun],
    )
    parser.own_config = True
    config = next(a for a in parser._actions if a.dest == "config")
    config.default, config.help = None, "merge recipe or mergekit-moe YAML file (docs/merging.md)"


def merge_config(args):
    """The `MergeConfig` of the --config file with the flags over it."""
    from ..merging.config import config_from_dict, read_yaml
    from ..merging.mergekit import from_mergekit

    fields = from_mergekit(read_yaml(args.config), args.config) if args.config else {}
    for flag in dataclasses.fields(MergeFlags):
        value = getattr(args, flag.name)
        if value is not None and flag.name not in ("experts", "shared_expert", "residual_scale"):
            fields[flag.name] = value
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
    names = ["config", *(f.name for f in dataclasses.fields(MergeFlags))]
    given = [flag(name) for name in names if getattr(args, name) is not None]
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
    from ..conversion.settings import RunOptions
    from .convert import parameters_text

    run_options = RunOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MergeRun)})
    if args.add_expert or args.into:
        result = add_expert(args, run_options)
    else:
        from ..merging.pipeline import merge

        given = [flag(f.name) for f in dataclasses.fields(AddExpertFlags) if getattr(args, f.name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} describe the expert --add-expert adds: give --add-expert and --into.")
        result = merge(merge_config(args), run_options)
    print(f"wrote {result.output_dir}")
    print(parameters_text(result.total_parameters, result.active_parameters))

"""`llama-moe`: convert dense LLaMA checkpoints to MoE, inspect them, chat with them, push them to the Hub.

A thin layer over the Python API in `llama_moe_hf.conversion` (docs/cli.md). Bad input ends with one
`error: ...` line and exit status 2, never a traceback.
"""

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from .conversion import FAMILIES, METHODS, ConversionOptions, convert_to_moe, count_parameters, push_folder
from .conversion.checkpoint import read_shapes
from .conversion.convert import DTYPES, ROUTER_INITS
from .modeling.configuration_llama_moe import ROUTER_TYPES

# ConversionOptions fields with a hand-written flag below; any other field gets a generic `--field-name` flag.
_EXPLICIT_FIELDS = {
    "method", "num_experts", "top_k", "num_shared_experts", "score_scale_factor", "router_init", "router_type",
    "moe_layers", "seed", "dtype", "max_shard_size", "allow_pickle", "base_model", "license", "repo_id", "progress",
    "family",
}  # fmt: skip


def _add_option_flags(parser: argparse.ArgumentParser) -> None:
    d = ConversionOptions()
    add = parser.add_argument
    add("--method", choices=sorted(METHODS), default=d.method, help="expert construction method (default: %(default)s)")
    add("--num-experts", type=int, default=d.num_experts, help="routed experts per MoE layer (default: %(default)s)")
    add("--top-k", type=int, default=d.top_k, help="experts per token (default: %(default)s)")
    add("--num-shared-experts", type=int, default=d.num_shared_experts, help="always-on experts (split methods)")
    add("--score-scale-factor", type=float, help="expert output scale (default: N/k for splits, 1.0 for upcycle)")
    add("--router-init", choices=ROUTER_INITS, default=d.router_init, help="router weights (default: %(default)s)")
    add("--router-type", choices=ROUTER_TYPES, default=d.router_type, help="routing function (default: %(default)s)")
    add("--moe-layers", nargs="+", metavar="L", help="decoder layers to convert: '0 2 5', '0-7', 'last:2', 'every:2' (default: all)")
    add("--seed", type=int, default=d.seed, help="seed of random splits and router init (default: %(default)s)")
    add("--dtype", choices=sorted(DTYPES), help="output weights dtype (default: the source dtype)")
    add("--max-shard-size", default=d.max_shard_size, help="largest safetensors shard (default: %(default)s)")
    add("--allow-pickle", action="store_true", help="accept pickled pytorch_model.bin sources (runs pickle code)")
    add("--base-model", help="Hub id of the source for the model card (automatic for Hub sources)")
    add("--license", help="model card license (default: the source's, if its README.md says)")
    add("--family", choices=sorted(FAMILIES), default=d.family, help="output model family (default: %(default)s)")
    add("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    for f in dataclasses.fields(ConversionOptions):  # fields added by other conversion methods
        if f.name in _EXPLICIT_FIELDS:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            add(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata.get("help"))
        else:
            kind = type(f.default) if f.default is not None else f.metadata.get("type", str)
            add(flag, type=kind, default=f.default, help=f.metadata.get("help"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llama-moe", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    convert = commands.add_parser("convert", help="convert a dense LLaMA checkpoint into a LlamaMoE checkpoint")
    convert.add_argument("--model", help="local folder, Hub repo id or .gguf file (default: SmolLM2-135M-Instruct)")
    convert.add_argument("--output", required=True, help="output folder (must not exist unless --overwrite)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing output folder at the end")
    convert.add_argument("--revision", help="Hub revision of --model")
    convert.add_argument("--token", help="Hugging Face token (default: the logged-in one)")
    _add_option_flags(convert)
    convert.add_argument("--push-to-hub", action="store_true", help="upload the result to --repo-id when done")
    convert.add_argument("--repo-id", help="Hub repository ORG/NAME (also used in the model card's snippets)")
    convert.add_argument("--private", action="store_true", help="create the Hub repository as private")

    push = commands.add_parser("push", help="upload a converted folder (with its model card) to the Hub")
    push.add_argument("folder")
    push.add_argument("--repo-id", required=True, help="Hub repository ORG/NAME")
    push.add_argument("--private", action="store_true", help="create the repository as private")
    push.add_argument("--token", help="Hugging Face token (default: the logged-in one)")
    push.add_argument("--dry-run", action="store_true", help="print the files and the card, upload nothing")

    info = commands.add_parser("info", help="print a converted model's MoE settings and parameter counts")
    info.add_argument("folder")

    chat = commands.add_parser("chat", help="answer one prompt with greedy decoding and the chat template")
    chat.add_argument("folder")
    chat.add_argument("--prompt", required=True)
    chat.add_argument("--max-new-tokens", type=int, default=64)
    return parser


def _parameters_text(total: int, active: int) -> str:
    return f"total parameters: {total:,}\nactive parameters per token: {active:,} ({100 * active / total:.1f}%)"


def _convert(args) -> None:
    if args.push_to_hub and not args.repo_id:
        raise ValueError("--push-to-hub needs --repo-id ORG/NAME.")
    if args.moe_layers:
        args.moe_layers = ",".join(args.moe_layers)  # a pattern, resolved against the source's layer count
    fields = {f.name for f in dataclasses.fields(ConversionOptions)}
    options = ConversionOptions(**{k: v for k, v in vars(args).items() if k in fields})
    result = convert_to_moe(
        args.model, args.output, options, overwrite=args.overwrite, token=args.token, revision=args.revision
    )
    print(f"wrote {result.output_dir}")
    print(_parameters_text(result.total_parameters, result.active_parameters))
    if args.push_to_hub:
        print(f"pushed: {push_folder(result.output_dir, args.repo_id, private=args.private, token=args.token)}")


def _push(args) -> None:
    result = push_folder(args.folder, args.repo_id, private=args.private, token=args.token, dry_run=args.dry_run)
    print(result.describe() if args.dry_run else f"pushed: {result}")


def _info(args) -> None:
    from transformers import AutoConfig

    folder = Path(args.folder).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a model folder (no config.json).")
    config = AutoConfig.from_pretrained(folder)  # the package is imported: LlamaMoE configs need no remote code
    total, active = count_parameters(config, read_shapes(folder))
    print(f"{folder}: {type(config).__name__} ({config.model_type}), {config.num_hidden_layers} layers")
    if getattr(config, "num_attention_experts", None):
        print(
            f"attention experts: {config.num_attention_experts} ({config.attention_expert_granularity}, "
            f"top-{config.num_attention_experts_per_tok}), attention MoE layers {config.attention_moe_layers}"
        )
    if getattr(config, "moe_layers", None):
        print(
            f"experts: {config.num_experts} routed (top-{config.num_experts_per_tok}, size "
            f"{config.moe_intermediate_size}), {config.num_shared_experts} shared, MoE layers {config.moe_layers}"
        )
    if getattr(config, "conversion_info", None):
        print(f"conversion: {json.dumps(config.conversion_info, sort_keys=True)}")
    print(_parameters_text(total, active))


def _chat(args) -> None:
    from .conversion.chat import chat

    print(chat(args.folder, args.prompt, max_new_tokens=args.max_new_tokens))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    package_logger = logging.getLogger("llama_moe_hf")  # our progress messages (e.g. the calibration corpus used)
    if not package_logger.handlers:
        package_logger.addHandler(logging.StreamHandler())
        package_logger.setLevel(logging.INFO)
    try:
        {"convert": _convert, "push": _push, "info": _info, "chat": _chat}[args.command](args)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

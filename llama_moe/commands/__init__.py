"""`llama-moe`: convert dense LLaMA checkpoints to MoE, inspect, analyse and evaluate them, chat with them, push them
to the Hub, and prepare training data (similarity-batched, or the offline demonstration sets).

Each command is a module with `register(subparsers)` and `run(args)`, thin over the Python API; the command line is
`parsing.Parser` (TRL's `TrlParser`: dataclass flags, `--config` recipe files with flags overriding them). Nothing
heavy is imported before a command runs. Bad input ends with one `error: ...` line and exit status 2, never a traceback.
"""

import importlib
import logging
import sys

from . import analyze, batch_similar, chat, convert, evaluate, export, heal, info, merge, offline_data, push, upgrade

COMMANDS = {
    "convert": convert,
    "merge": merge,
    "heal": heal,
    "info": info,
    "chat": chat,
    "push": push,
    "upgrade": upgrade,
    "analyze": analyze,
    "eval": evaluate,
    "export": export,
    "batch-similar": batch_similar,
    "offline-data": offline_data,
}


def build_parser():
    from ..parsing import Parser, hyphenate

    parser = Parser(prog="llama-moe", description=" ".join(__doc__.split("\n\n")[0].split()))
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in COMMANDS.values():
        module.register(subparsers)
    hyphenate(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    package_logger = logging.getLogger("llama_moe")  # progress messages (e.g. the calibration corpus used)
    handler, level = None, package_logger.level
    if not package_logger.handlers:  # a program that configured logging itself keeps its own
        handler = logging.StreamHandler()  # the stderr of this call; removed when it returns
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.INFO)
    try:
        return _run(argv)
    finally:  # the handler is this call's; code that calls the Python API afterwards logs as it configured
        if handler is not None:
            package_logger.removeHandler(handler)
            package_logger.setLevel(level)


def _run(argv: list[str]) -> int:
    try:
        if argv[:1] == ["convert"]:
            argv = convert.expand_preset(argv)  # a named recipe file: read like --config FILE
        try:
            (args,) = build_parser().parse_args_and_config(argv)
        except SystemExit as exit:  # --help, or a flag error (one line printed already)
            return exit.code or 0
        importlib.import_module("llama_moe_hf")  # registers the families (a transformers it refuses: one line)
        COMMANDS[args.command].run(args)
    except (ValueError, OSError, ImportError) as error:  # bad input, files, a missing optional package
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0

"""The one argument parser of the `llama-moe` command and the training recipes: TRL's `TrlParser` (dataclass fields
as flags; `--config FILE`, a flat YAML file of them, with flags overriding it), made for users rather than developers:

- every mistake is one `error: ...` line and exit status 2: a YAML syntax error names the file, line and column; an
  unknown key names itself and the closest valid one; a recipe file sets the options of its own command only;
- `--help` lists `--config`, describes `--no_X` as the flag typed, and shows a default only where it says something;
- `preflight(values)` runs on the parsed values before the dataclasses are built (`preflight.check_training`).

Light (no torch or transformers): `llama-moe --help` answers at once.
"""

import argparse
import copy
import difflib
import logging
import os
import sys
import textwrap
import traceback

from safetensors import SafetensorError
from trl import TrlParser

CONFIG_HELP = "a YAML file of these options (flat `name: value`, named as the flags); flags given as well override it"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only for options that take a value, have a (non-empty) default the help does not describe;
    wraps descriptions but keeps the epilogs' indented lines (lists in columns) as they are."""

    def _get_help_string(self, action):
        help = action.help or ""
        default = action.default
        if action.nargs == 0 or default is None or default == argparse.SUPPRESS or default == [] or "default" in help:
            return help
        return super()._get_help_string(action)

    def _format_action_invocation(self, action):
        # HfArgumentParser accepts `--a_b` and `--a-b`; the help shows the first spelling only (`hyphenate` orders them)
        spellings = action.option_strings
        if len(spellings) == 2 and spellings[0].replace("_", "-") == spellings[1].replace("_", "-"):
            action = copy.copy(action)
            action.option_strings = spellings[:1]
        return super()._format_action_invocation(action)

    def _fill_text(self, text, width, indent):
        return "\n".join(
            line if line[:1].isspace() else textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
            for line in text.splitlines()
        )


class Parser(TrlParser):
    own_config = False  # the command reads `--config FILE` itself (a nested file, not flag defaults)

    def __init__(self, dataclass_types=None, *, preflight=None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(dataclass_types, **kwargs)
        self.preflight = preflight
        if self.dataclass_types:  # TRL reads --config before parsing; listed here so that --help shows it
            self.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help=CONFIG_HELP)
        negations = [a for a in self._actions if isinstance(a, argparse._StoreFalseAction)]
        flags = {a.dest: a.option_strings[0] for a in self._actions if a.option_strings and a not in negations}
        for action in negations:  # HfArgumentParser gives `--no_X` the help of `--X`
            if action.dest in flags:
                action.help = f"turn {flags[action.dest]} off"

    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")

    def fail(self, message):  # one line for what is not a usage mistake
        self.exit(2, f"error: {message}\n")

    def run(self, function, *args):
        """`function(*args)`, a recipe's work: bad input found on the way (a line of data that is not JSON, a truncated
        shard, a missing optional package, a full disk at the final save) is one line and exit status 2, as in
        `llama-moe`'s commands. An error raised inside the Trainer's training loop keeps its traceback: that is a
        failure to debug, not input to correct."""
        try:
            result = function(*args)
        except (ValueError, OSError, ImportError, SafetensorError) as error:  # SafetensorError: e.g. a full disk
            frames = traceback.extract_tb(error.__traceback__)
            if any(frame.name == "_inner_training_loop" for frame in frames):
                raise
            end_process_group()
            self.fail(str(error))
        finish_distributed_run()
        return result

    def parse_args_and_config(self, args=None) -> tuple:
        args = list(sys.argv[1:] if args is None else args)
        parser = self._command_parser(args)
        path, args = (None, args) if parser.own_config else parser._take_config(args)
        in_file = parser._apply_config(path) if path is not None else set()
        args = self._save_strategy(args)
        try:  # the preflight, then the dataclasses' own checks (TrainingArguments' FSDP settings, ...)
            if self.preflight is not None:
                self.preflight(self.parse_known_args(args)[0])
            parsed = self.parse_args_into_dataclasses(args)
        except (ValueError, ImportError, OSError) as error:
            self.fail(str(error))
        if len(parsed) == 1 and isinstance(parsed[0], argparse.Namespace):  # a command's flags: what was given, too
            parsed[0].given = frozenset(in_file | self._given_on_command_line(args))
        return parsed

    def _given_on_command_line(self, args: list[str]) -> set[str]:
        """The dests the command line sets, whatever their values (abbreviations included, as argparse reads them):
        parsed once more with every default a marker that no value equals."""
        marker, parsers = object(), [self, self._command_parser(args)]
        saved = [(action, action.default) for parser in parsers for action in parser._actions]
        for action, _ in saved:
            action.default = marker
        try:
            namespace = self.parse_known_args(args)[0]
        finally:
            for action, default in saved:
                action.default = default
        return {dest for dest, value in vars(namespace).items() if value is not marker}

    def _command_parser(self, args: list[str]) -> "Parser":
        """The parser of the subcommand `args` names (a recipe file sets its options only), else this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = next((arg for arg in args if not arg.startswith("-")), None)
                if name is not None and name not in action.choices:
                    self.error(f"unknown command {name!r}; the commands are {', '.join(action.choices)}")
                return action.choices.get(name, self)
        return self

    def _save_strategy(self, args: list[str]) -> list[str]:
        """`--save_steps` / `--save_total_limit` given while the recipe file says `save_strategy: no` switch it to
        "steps" (said on stderr); with `--save_strategy no` given too they contradict it: one error line."""
        if "--save_strategy" not in self._option_string_actions:
            return args
        given = {arg.split("=", 1)[0][2:].replace("-", "_") for arg in args if arg.startswith("--")}
        asks = [name for name in ("save_steps", "save_total_limit") if name in given]
        if not asks or str(self.parse_known_args(args)[0].save_strategy) != "no":
            return args
        flags = " and ".join(f"--{name}" for name in asks)
        if "save_strategy" in given:
            self.error(f"{flags} cannot go with --save_strategy no (no checkpoint is written): drop one")
        print(f"note: {flags} given, so save_strategy is 'steps' (the recipe file says 'no')", file=sys.stderr)
        return [*args, "--save_strategy", "steps"]

    def _take_config(self, args: list[str]) -> tuple[str | None, list[str]]:
        """(the `--config FILE` / `--config=FILE` path, the other arguments)."""
        for i, arg in enumerate(args):
            if (arg == "--config" or arg.startswith("--config=")) and "--config" not in self._option_string_actions:
                self.error("--config: this command takes no options file")
            if arg == "--config" and i + 1 < len(args):
                return args[i + 1], args[:i] + args[i + 2 :]
            if arg.startswith("--config="):
                return arg.partition("=")[2], args[:i] + args[i + 1 :]
        return None, args

    def _apply_config(self, path: str) -> set[str]:
        """The file's values become the defaults, so that flags override them; `env:` sets environment variables,
        as in TRL's own files. Returns the keys the file sets."""
        try:
            config = read_config(path)
        except ValueError as error:
            self.fail(str(error))
        for key, value in (config.pop("env", None) or {}).items():
            os.environ[key] = str(value)
        actions = {action.dest: action for action in self._actions if action.dest not in ("help", "config")}
        for key, value in config.items():
            if key not in actions:
                close = difflib.get_close_matches(key, actions, n=1)
                self.error(f"{path}: unknown option {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
            actions[key].default, actions[key].required = value, False
        return set(config)


def hyphenate(parser: argparse.ArgumentParser) -> None:
    """Make `--a-b` the spelling that `parser` and its subcommands show (usage, help, errors) where a flag also
    accepts `--a_b`: the `llama-moe` command's spelling. The training recipes keep transformers' `--a_b`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                hyphenate(subparser)
        action.option_strings.sort(key=lambda option: "_" in option)
        if action.help and action.help.startswith("turn --"):  # a negation's help names the flag it turns off
            action.help = "turn --" + action.help[len("turn --") :].replace("_", "-")


def end_process_group() -> bool:
    """Destroy the torch.distributed process group a run set up (the Trainer never does); whether there was one."""
    distributed = sys.modules.get("torch.distributed")  # only if torch was imported: this module stays light
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return False
    distributed.destroy_process_group()
    return True


def finish_distributed_run() -> None:
    """In a process of a distributed run whose work is done and written: destroy the process group and exit at once,
    without interpreter finalization. There gloo's worker threads can still hold tensors and abort the process
    ("terminate called without an active exception", SIGABRT) even after `destroy_process_group`: seen in CI with
    FSDP2 and DDP over gloo on CPU (torch 2.13; pytorch/pytorch#179291 describes it). Elsewhere: nothing."""
    if end_process_group():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def read_config(path: str) -> dict:
    """The mapping in the YAML file `path` (empty: {}); one ValueError naming the file (and line) for anything else."""
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            config = yaml.safe_load(file)
    except OSError as error:
        raise ValueError(f"cannot read --config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{path}{where}: not valid YAML: {getattr(error, 'problem', None) or error}") from None
    if config is None:
        return {}
    if not isinstance(config, dict) or not isinstance(config.get("env") or {}, dict):
        raise ValueError(f"{path} must hold a YAML mapping of option: value (and `env:` a mapping of variables).")
    return config

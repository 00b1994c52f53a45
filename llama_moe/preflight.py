"""Checks made before any work starts (before a model is loaded, a dataset read or an optimizer built), so that a
missing optional package or an output that cannot be written fails in a second with one clear line, not minutes
later. Light: the command line runs them before torch is imported.

    require(module, needed_for)     an optional package (an extra of setup.py) is installed
    check_writable(path, flag)      a file or folder can be created at `path`
    check_training(values)          a training recipe's output_dir, DeepSpeed and its DeepSpeed/FSDP config files,
                                    before TrainingArguments is built
"""

import importlib.util
import json
import os
import tempfile
from pathlib import Path

# Optional packages a command path imports: module -> (distribution, the setup.py extra that installs it).
OPTIONAL = {
    "lm_eval": ("lm-eval", "eval"),
    "sentence_transformers": ("sentence-transformers", "sentence-transformers"),
    "faiss": ("faiss-cpu", "similarity"),
    "deepspeed": ("deepspeed", "deepspeed"),
}


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (DeepSpeed or lm-eval take seconds to import)."""
    return importlib.util.find_spec(module) is not None


def require(module: str, needed_for: str) -> None:
    """An ImportError naming the pip command when the optional package `module` is missing."""
    if not installed(module):
        package, extra = OPTIONAL[module]
        raise ImportError(f"{needed_for} needs {package}: pip install 'llama-moe-hf[{extra}]'")


def check_writable(path, flag: str) -> Path:
    """`path` (absolute) if a file or folder can be created there: the nearest existing folder above it takes a new
    entry. Tried rather than read from the permission bits, which root, read-only mounts and /proc all defeat."""
    path = Path(path).expanduser().absolute()
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"{flag} {path} cannot be written: {parent} is a file, not a folder.")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=parent))
    except OSError as error:
        raise PermissionError(
            f"{flag} {path} cannot be written: creating an entry in {parent} fails ({error.strerror})."
        ) from None
    return path


def check_training(values) -> None:
    """A training recipe's parsed values (argparse namespace of `TrainingArguments` fields): its output_dir can be
    written, DeepSpeed is installed when a DeepSpeed config asks for it (building TrainingArguments without it fails
    with an unrelated TypeError), and the DeepSpeed and FSDP config files are JSON objects (else TrainingArguments
    or accelerate fail deep inside with a message that names no file). Distilling recipes add their teacher's
    check (`training.distill`)."""
    if values.output_dir:
        check_writable(values.output_dir, "--output_dir")
    if values.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        require("deepspeed", "--deepspeed (or an accelerate DeepSpeed config)")
    for flag, path in config_files(values):
        check_json_file(path, flag)


def config_files(values) -> list[tuple[str, str]]:
    """(flag, path) of the DeepSpeed/FSDP JSON files the run names: `--deepspeed`, `--fsdp_config` (given as paths;
    a YAML `--config` may give them as mappings instead) and `accelerate launch`'s DeepSpeed config file."""
    files = [
        (flag, getattr(values, name, None))
        for flag, name in (("--deepspeed", "deepspeed"), ("--fsdp_config", "fsdp_config"))
    ]
    files.append(("the accelerate config's deepspeed_config_file", os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")))
    return [(flag, path) for flag, path in files if isinstance(path, str) and path]


def check_json_file(path: str, flag: str) -> None:
    """A ValueError naming `flag` and `path` unless the file holds a JSON object."""
    try:
        content = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot be read ({error.strerror}).") from None
    except ValueError as error:
        raise ValueError(f"{flag} {path}: not valid JSON ({error}).") from None
    if not isinstance(content, dict):
        raise ValueError(f"{flag} {path}: must hold a JSON object of settings.")

"""Checks made before any work starts (before a model is loaded, a dataset read or an optimizer built), so that a
missing optional package or an output that cannot be written fails in a second with one clear line, not minutes
later. Light: the command line runs them before torch is imported.

    require(module, needed_for)     an optional package (an extra of setup.py) is installed
    check_writable(path, flag)      a file or folder can be created at `path`
    check_training(values)          a training recipe's output_dir and DeepSpeed, before TrainingArguments is built
"""

import importlib.util
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
    written, and DeepSpeed is installed when a DeepSpeed config asks for it (building TrainingArguments without it
    fails with an unrelated TypeError). Distilling recipes add their teacher's check (`training.distill`)."""
    if values.output_dir:
        check_writable(values.output_dir, "--output_dir")
    if values.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        require("deepspeed", "--deepspeed (or an accelerate DeepSpeed config)")

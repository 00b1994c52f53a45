"""Real English technical text that is on every machine: the docstrings of Python's standard library."""

import importlib
import inspect
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

# Modules whose import has side effects (opening windows, printing, starting interpreters) or is slow.
SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data", "lib2to3", "test"}


def stdlib_modules() -> Iterator[ModuleType]:
    """The public top-level standard-library modules that import cleanly, in sorted order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(sys.stdlib_module_names):
            if name.startswith("_") or name in SKIP_MODULES:
                continue
            try:
                yield importlib.import_module(name)
            except Exception:
                continue


def stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """Docstrings of the public stdlib modules and their public members, in a fixed order (about 0.6 MB).

    Deterministic for a given Python version, needs no download; used as the built-in calibration and test corpus.
    """
    texts = []
    for module in stdlib_modules():
        members = [module] + [getattr(module, attr, None) for attr in sorted(getattr(module, "__all__", []))]
        for member in members:
            doc = inspect.getdoc(member) if member is not None else None
            if doc and len(doc) >= min_chars:
                texts.append(doc)
    return list(dict.fromkeys(texts))  # drop repeats (re-exported members), keep order

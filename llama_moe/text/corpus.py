"""Real text that is on every machine with Python, no download: the built-in corpora.

`docstrings` (the default): the standard library's docstrings, English technical prose.
`mixed` (`--calibration-data builtin:mixed`): three kinds interleaved, a document of each in turn so that any prefix
holds all three (calibration reads the first tokens): the docstrings, code (the standard library's own source, a
top-level function or class at a time) and project descriptions in Markdown and reStructuredText (the README of each
installed distribution but this package, from its metadata, so it depends on what is installed). Debian's licences
and manual pages, the texts quality claims are confirmed on (`benchmarks/common.py`), are none of these; descriptions
that carry a whole licence are left out. The code overlaps `llama-moe offline-data`'s pretrain/code split.
Measured as calibration for the sparsity presets in benchmarks/reports/calibration-and-levers.md ("Calibration corpus
and the levers"): the docstrings are better.
"""

import ast
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

# Modules whose import has side effects (opening windows, printing, starting interpreters) or is slow.
SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data", "lib2to3", "test"}
# Phrases of whole licence texts (MIT, BSD, Apache, GPL): a description quoting one is a licence, a held-out domain.
LICENCE_PHRASES = (
    "Permission is hereby granted",
    "Redistribution and use in source and binary forms",
    "TERMS AND CONDITIONS",
    "GNU GENERAL PUBLIC LICENSE",
)
DEFAULT_DESCRIPTION = "built-in corpus: "  # how the default corpus's description starts (`conversion_info`)
DOCUMENT_CHARS = 2000  # each built-in document is cut here, so that no kind outweighs the others by its lengths


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


def stdlib_sources() -> Iterator[tuple[str, str]]:
    """(module name, source text) of the pure-Python top-level stdlib modules, in a fixed order."""
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            yield name, Path(spec.origin).read_text(encoding="utf-8", errors="replace")


def stdlib_definitions() -> Iterator[tuple[str, ast.FunctionDef | ast.ClassDef, str]]:
    """(module, node, source) of each public top-level function and class of the stdlib, in a fixed order."""
    for module, text in stdlib_sources():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.split("\n")  # as ast numbers lines; ast.get_source_segment splits the file again for every node
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                last = lines[node.end_lineno - 1].encode()[: node.end_col_offset].decode()  # offsets count bytes
                yield module, node, "\n".join([*lines[node.lineno - 1 : node.end_lineno - 1], last])


def stdlib_code(min_chars: int = 200) -> list[str]:
    """The source of the public top-level functions and classes of the stdlib, in a fixed order."""
    return [source for _, _, source in stdlib_definitions() if len(source) >= min_chars]


def package_descriptions(min_chars: int = 500) -> list[str]:
    """The long description (README) of each installed distribution, by name (the first of a name on `sys.path`);
    this package's own and whole licences left out."""
    found = {}
    for dist in importlib.metadata.distributions():
        metadata = dist.metadata
        if metadata is None:  # an empty dist-info folder
            continue
        name = (metadata.get("Name") or "").lower()
        body = metadata.get_payload() or metadata.get("Description") or ""
        if (
            name
            and name != "llama-moe-hf"
            and name not in found
            and len(body) >= min_chars
            and not any(p in body for p in LICENCE_PHRASES)
        ):
            found[name] = body
    return [found[name] for name in sorted(found)]


BUILTIN_CORPORA = ("docstrings", "mixed")  # `builtin:NAME`; None is the first


def builtin_corpus(name: str = "docstrings") -> tuple[list[str], str]:
    """A built-in corpus (see the module's docstring) and a one-line description of it."""
    if name in ("chat", "chat-mixed", "chat-self", "self"):
        raise ValueError(
            f"builtin:{name} is written by the dense model during a conversion (`llama-moe convert`, text/chat.py); "
            "it is no text to read here: `llama-moe offline-data --chat-tokens N` writes it to a file."
        )
    if name not in BUILTIN_CORPORA:
        raise ValueError(f"Unknown built-in corpus {name!r}: choose one of {', '.join(BUILTIN_CORPORA)}.")
    texts, description = _mixed_corpus() if name == "mixed" else _docstrings_corpus()
    return list(texts), description


@functools.cache  # read once per process: conversions, their checks and tests ask for it again and again
def _docstrings_corpus() -> tuple[tuple[str, ...], str]:
    texts = stdlib_docstrings()
    return tuple(texts), f"{DEFAULT_DESCRIPTION}Python stdlib docstrings ({len(texts)} docs)"


def in_turn(kinds) -> list[str]:
    """A document of each kind (lists of texts) in turn until every kind runs out, each cut at `DOCUMENT_CHARS`, so
    that any prefix holds every kind and no kind outweighs the others by its lengths."""
    kinds = list(kinds)
    longest = max(map(len, kinds))
    return [docs[i][:DOCUMENT_CHARS] for i in range(longest) for docs in kinds if i < len(docs)]


@functools.cache
def _mixed_corpus() -> tuple[tuple[str, ...], str]:
    kinds = {
        "stdlib docstrings": stdlib_docstrings(),
        "stdlib code": stdlib_code(),
        "installed packages' READMEs": package_descriptions(),
    }
    texts = in_turn(kinds.values())
    counts = ", ".join(f"{len(docs)} {kind}" for kind, docs in kinds.items())
    return tuple(texts), f"built-in corpus mixed, three kinds in turn: {counts}"

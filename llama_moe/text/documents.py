"""Documents from anywhere: a local .txt/.md/.json/.jsonl/.parquet file or folder, a `datasets` name, or the
built-in corpus (Python standard-library docstrings, or `builtin:mixed`; no download).

load_texts       the whole source as a list of documents, and a line saying where they came from
iter_documents   the same sources one document at a time, never all in memory (analyze, eval)
"""

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from .corpus import builtin_corpus

BUILTIN = "builtin:"  # `builtin:NAME` names a built-in corpus (text/corpus.py); no spec is the default one

TEXT_SUFFIXES = (".txt", ".md", ".json", ".jsonl", ".parquet")


def _texts_from_records(records: list, source: str, text_column: str | None) -> list[str]:
    """Documents from a list of strings or of dict rows (the `text_column`, else `text`, else the only str field)."""
    texts = []
    for row in records:
        if isinstance(row, str):
            texts.append(row)
            continue
        if not isinstance(row, dict):
            raise ValueError(f"{source}: expected strings or objects with a text field, found {type(row).__name__}.")
        column = text_column or _pick_text_column(row, source)
        if column not in row:
            raise ValueError(f"{source}: a row has no {column!r} field (fields: {sorted(row)}).")
        texts.append(str(row[column]))
    return texts


def _pick_text_column(row: dict, source: str) -> str:
    if "text" in row:
        return "text"
    string_fields = [key for key, value in row.items() if isinstance(value, str)]
    if len(string_fields) != 1:
        raise ValueError(
            f"{source}: cannot tell which field holds the text (fields: {sorted(row)}); name the text field 'text'."
        )
    return string_fields[0]


def _read_text_file(path: Path, text_column: str | None) -> list[str]:
    """One file -> documents. .txt/.md: the whole file is one document; .json: a list (or {"data": [...]}) of
    strings or rows; .jsonl: one string or row per line; .parquet: the text column of every row."""
    return list(_iter_text_file(path, text_column))


def _iter_text_file(path: Path, text_column: str | None, piece_chars: int | None = None) -> Iterator[str]:
    """`_read_text_file` one document at a time; with `piece_chars` a .txt/.md file comes in pieces of about that
    many characters (cut at line ends), so a large file is never held whole. A .json list is read whole."""
    suffix = path.suffix.lower()
    if suffix in (".txt", ".md"):
        yield from _text_pieces(path, piece_chars)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            yield from _texts_from_records(batch.to_pylist(), str(path), text_column)
    elif suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield from _texts_from_records([_json_value(line, path, number)], str(path), text_column)
    else:
        records = _json_value(path.read_text(encoding="utf-8") or "[]", path)
        if isinstance(records, dict):
            lists = [value for value in records.values() if isinstance(value, list)]
            if len(lists) != 1:
                raise ValueError(f"{path}: expected a JSON list of documents (or an object holding one list).")
            records = lists[0]
        yield from _texts_from_records(records, str(path), text_column)


def _text_pieces(path: Path, piece_chars: int | None) -> Iterator[str]:
    if piece_chars is None:
        yield path.read_text(encoding="utf-8", errors="replace")
        return
    piece, size = [], 0
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            piece.append(line)
            size += len(line)
            if size >= piece_chars:
                yield "".join(piece)
                piece, size = [], 0
    if piece:
        yield "".join(piece)


def _json_value(text: str, path: Path, line: int | None = None):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        where = f"{path} line {line}" if line else str(path)
        raise ValueError(f"{where} is not valid {path.suffix[1:].upper()}: {error}") from None


def _iter_dataset_texts(name: str, text_column: str | None, split: str, dataset_loader: Callable, what: str):
    """A `datasets` dataset, `NAME` or `NAME:CONFIG`, streamed: documents as they arrive."""
    path, _, config = name.partition(":")
    try:
        dataset = dataset_loader(path, config or None, split=split, streaming=True)
        for row in dataset:
            yield from _texts_from_records([row], name, text_column)
    except ValueError:
        raise
    except Exception as error:
        raise ValueError(
            f"Could not load {what.lower()} {name!r}: it is not a local file or folder, and "
            f"datasets.load_dataset({path!r}{', ' + repr(config) if config else ''}, split={split!r}) failed "
            f"({type(error).__name__}: {error}). Pass a local .txt/.json/.jsonl/.parquet file or folder, a dataset "
            "reachable from here, or omit it to use the built-in corpus."
        ) from None


def _load_dataset_texts(
    name: str, text_column: str | None, split: str, max_chars: int | None, dataset_loader: Callable, what: str
) -> list[str]:
    """The streamed dataset's documents until `max_chars` characters are read."""
    texts, total = [], 0
    for text in _iter_dataset_texts(name, text_column, split, dataset_loader, what):
        texts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    return texts


def _text_files(path: Path, what: str) -> list[Path]:
    """The files of a folder or the one file `path` names, checked for a readable suffix."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"{what} folder {path} holds no {'/'.join(TEXT_SUFFIXES)} files.")
        return files
    if path.suffix.lower() not in TEXT_SUFFIXES:
        raise ValueError(f"{what} file {path} must end in one of {', '.join(TEXT_SUFFIXES)}.")
    return [path]


def refuse_missing_file(spec: str, what: str = "Data") -> None:
    """Refuse at once a spec that can only mean a local file (a data-file suffix, or a path from the root, the home or
    the working folder) when there is none: no Hub dataset is named so, and asking the Hub first costs its retries."""
    path = Path(spec).expanduser()
    local = path.suffix.lower() in TEXT_SUFFIXES or spec.startswith(("/", "./", "../", "~"))
    if local and not path.exists():
        raise ValueError(f"{what} file {spec} does not exist.")


def _builtin_name(spec: str | None) -> tuple[str, ...]:
    """`builtin_corpus`'s arguments for `spec` (None: the default corpus)."""
    return () if spec is None else (spec.removeprefix(BUILTIN),)


def iter_documents(
    spec: str | None,
    *,
    text_column: str | None = None,
    split: str = "train",
    dataset_loader: Callable | None = None,
    what: str = "Data",
    piece_chars: int = 1 << 16,
) -> Iterator[str]:
    """The documents of `spec` (as `load_texts` reads it) one at a time, never all in memory: for
    commands that read as much as they need of sources of any size (`analyze`, `eval`). Empty documents are
    skipped; long .txt files come in pieces of about `piece_chars` characters."""
    if spec is None or spec.startswith(BUILTIN):
        yield from (text for text in builtin_corpus(*_builtin_name(spec))[0] if text.strip())
        return
    path = Path(spec).expanduser()
    refuse_missing_file(spec, what)
    if path.exists():
        texts = (text for file in _text_files(path, what) for text in _iter_text_file(file, text_column, piece_chars))
    else:
        if dataset_loader is None:
            from datasets import load_dataset as dataset_loader
        texts = _iter_dataset_texts(spec, text_column, split, dataset_loader, what)
    yield from (text for text in texts if text.strip())


def load_texts(
    spec: str | None,
    *,
    text_column: str | None = None,
    split: str = "train",
    max_chars: int | None = None,
    dataset_loader: Callable | None = None,
    what: str = "Calibration data",
) -> tuple[list[str], str]:
    """Documents (`what`: calibration data, or the documents `batch-similar` orders) and a one-line description of
    where they came from (for the log).

    `spec` is None (the built-in corpus: Python standard-library docstrings, no download), `builtin:NAME` (another
    built-in corpus, `text/corpus.py`: `builtin:mixed`), a local .txt/.md/.json/
    .jsonl/.parquet file, a folder (its files with those suffixes, recursively, in sorted order), or a
    `datasets` name (`NAME` or `NAME:CONFIG`; needs the Hub or a local datasets cache). `max_chars` stops reading a
    streamed dataset early. `dataset_loader` defaults to `datasets.load_dataset` (the seam tests replace).
    """
    if spec is None or spec.startswith(BUILTIN):
        return builtin_corpus(*_builtin_name(spec))
    path = Path(spec).expanduser()
    refuse_missing_file(spec, what)
    if path.exists():
        files = _text_files(path, what)
        texts = [text for file in files for text in _read_text_file(file, text_column)]
        where = f"local folder {path} ({len(files)} files, " if path.is_dir() else f"local file {path} ("
        description = f"{where}{len(texts)} docs)"
    else:
        if dataset_loader is None:
            from datasets import load_dataset as dataset_loader
        texts = _load_dataset_texts(spec, text_column, split, max_chars, dataset_loader, what)
        description = f"datasets {spec!r} split {split!r} ({len(texts)} docs)"
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise ValueError(f"{what} {spec!r} holds no text.")
    return texts, description

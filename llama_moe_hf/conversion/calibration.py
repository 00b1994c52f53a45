"""Calibration: the text a conversion runs the dense model on, and the context that runs it once.

load_calibration_texts   local file/folder, a `datasets` name, or the built-in corpus -> list of documents
iter_documents           the same sources one document at a time (commands that stream: analyze, eval)
token_blocks             documents -> `[seq_len]` token blocks as they are read, up to a token budget
token_stream             documents -> their first N tokens, `[N]`
tokenize_calibration     documents -> `[B, seq_len]` token ids (packed, EOS between documents)
CalibrationContext       one per conversion: loads the dense model at most once, records every statistic the
                         components asked for in one pass, and hands the results to them explicitly
"""

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .attention_fit import AttentionCalibration
from .corpus import stdlib_docstrings
from .statistics import CalibrationStatistics, LayerCalibration, collect_calibration

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".json", ".jsonl", ".parquet")


@contextlib.contextmanager
def transformers_progress_bars(enabled: bool):
    """transformers' own bars (its "Loading weights") shown or not, as ours are; the global switch is restored."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------------------------------------------
# Texts
# ----------------------------------------------------------------------------------------------------------------


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


def iter_documents(
    spec: str | None,
    *,
    text_column: str | None = None,
    split: str = "train",
    dataset_loader: Callable | None = None,
    what: str = "Data",
    piece_chars: int = 1 << 16,
) -> Iterator[str]:
    """The documents of `spec` (as `load_calibration_texts` reads it) one at a time, never all in memory: for
    commands that read as much as they need of sources of any size (`analyze`, `eval`). Empty documents are
    skipped; long .txt files come in pieces of about `piece_chars` characters."""
    if spec is None:
        yield from (text for text in stdlib_docstrings() if text.strip())
        return
    path = Path(spec).expanduser()
    if path.exists():
        texts = (text for file in _text_files(path, what) for text in _iter_text_file(file, text_column, piece_chars))
    else:
        if dataset_loader is None:
            from datasets import load_dataset as dataset_loader
        texts = _iter_dataset_texts(spec, text_column, split, dataset_loader, what)
    yield from (text for text in texts if text.strip())


def load_calibration_texts(
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

    `spec` is None (the built-in corpus: Python standard-library docstrings, no download), a local .txt/.md/.json/
    .jsonl/.parquet file, a folder (its files with those suffixes, recursively, in sorted order), or a
    `datasets` name (`NAME` or `NAME:CONFIG`; needs the Hub or a local datasets cache). `max_chars` stops reading a
    streamed dataset early. `dataset_loader` defaults to `datasets.load_dataset` (the seam tests replace).
    """
    if spec is None:
        texts = stdlib_docstrings()
        return texts, f"built-in corpus: Python stdlib docstrings ({len(texts)} docs)"
    path = Path(spec).expanduser()
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


def tokenize_calibration(texts: list[str], tokenizer, num_tokens: int, seq_len: int) -> torch.LongTensor:
    """Pack documents into `[num_tokens // seq_len, seq_len]` token ids, EOS between documents, in order.

    Uses the first `num_tokens` tokens (fewer, with a warning, when the texts are shorter); deterministic.
    """
    if seq_len < 2:
        raise ValueError(f"--calibration-seq-len must be at least 2, got {seq_len}.")
    if num_tokens < seq_len:
        raise ValueError(f"--calibration-tokens ({num_tokens}) must be at least one sequence ({seq_len} tokens).")
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + separator)
        if len(stream) >= num_tokens:
            break
    num_sequences = min(num_tokens, len(stream)) // seq_len
    if num_sequences == 0:
        raise ValueError(
            f"The calibration text has only {len(stream)} tokens, fewer than one sequence of {seq_len}; "
            "give more text or a smaller --calibration-seq-len."
        )
    if len(stream) < num_tokens:
        logger.warning(
            "Calibration text has %d tokens, fewer than the %d asked for; using %d sequences of %d.",
            len(stream),
            num_tokens,
            num_sequences,
            seq_len,
        )
    return torch.tensor(stream[: num_sequences * seq_len], dtype=torch.long).view(num_sequences, seq_len)


def _document_tokens(documents, tokenizer) -> Iterator[list[int]]:
    """Each document's token ids, followed by EOS (when the tokenizer has one)."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text in documents:
        yield tokenizer(text, add_special_tokens=False)["input_ids"] + separator


def token_blocks(documents, tokenizer, seq_len: int, max_tokens: int) -> Iterator[torch.LongTensor]:
    """Pack streamed documents into `[seq_len]` blocks (EOS between documents), at most `max_tokens // seq_len` of
    them; only the current block's tokens are held."""
    buffer: list[int] = []
    remaining = max_tokens // seq_len
    for ids in _document_tokens(documents, tokenizer):
        buffer.extend(ids)
        while len(buffer) >= seq_len and remaining:
            yield torch.tensor(buffer[:seq_len], dtype=torch.long)
            buffer, remaining = buffer[seq_len:], remaining - 1
        if not remaining:
            return


def token_stream(documents, tokenizer, max_tokens: int) -> torch.LongTensor:
    """The first `max_tokens` tokens of the streamed documents (EOS between documents), `[N]`."""
    stream: list[int] = []
    for ids in _document_tokens(documents, tokenizer):
        stream.extend(ids)
        if len(stream) >= max_tokens:
            break
    return torch.tensor(stream[:max_tokens], dtype=torch.long)


# ----------------------------------------------------------------------------------------------------------------
# The context of one conversion
# ----------------------------------------------------------------------------------------------------------------


def data_path(recipe) -> str | None:
    """The recipe's calibration data, a local file or folder as its full path (a recipe is portable that way)."""
    data = recipe.calibration_data
    if data is not None and Path(data).expanduser().exists():
        return str(Path(data).expanduser().resolve())
    return data


class CalibrationContext:
    """What one conversion learns from running the dense model: computed once, passed explicitly to the components.

    Components first `request_*` the statistics they will use; `collect()` then loads the dense model (once) and
    records them all in a single no-gradient pass over the calibration tokens. Gradient passes (neuron importance)
    and k-means centroids are computed on demand from the same model and cached. `release()` drops the model before
    the streaming write.

    recipe: the calibration settings (`calibration_*`, `seed`). load_model / load_tokenizer: called at most once.
    input_ids: calibration tokens `[B, S]` to use instead of tokenizing the recipe's calibration data.
    """

    def __init__(
        self,
        recipe,
        load_model: Callable,
        load_tokenizer: Callable | None = None,
        *,
        input_ids=None,
        device: str | None = None,
        batch_size: int = 4,
        progress: bool = True,
    ):
        self.recipe = recipe
        self._load_model, self._load_tokenizer = load_model, load_tokenizer
        self._model = None
        self._released = False
        self._input_ids = input_ids
        self.data_description = "given token ids" if input_ids is not None else None
        self.device, self.batch_size, self.progress = device, batch_size, progress
        self.statistics = CalibrationStatistics()
        self._mlp_requests: set[int] = set()
        self._attention_requests: set[tuple[int, int]] = set()  # (layer, attention experts)
        self._attention: dict[tuple[int, int], AttentionCalibration] = {}
        self._embeddings_requested = False
        self._importance: dict[str, dict[int, LayerCalibration]] = {}
        self._centroids: dict[tuple[int, int], torch.Tensor] = {}  # (layer, experts) -> [E, H]

    def serves(self, recipe) -> bool:
        """Whether this context's statistics are those `recipe`'s calibration settings give (to share it)."""
        fields = ("calibration_tokens", "calibration_seq_len", "calibration_samples", "seed")
        same_data = self.data_description == "given token ids" or data_path(self.recipe) == data_path(recipe)
        return same_data and all(getattr(self.recipe, f) == getattr(recipe, f) for f in fields)

    # Requests, then one pass ---------------------------------------------------------------------------------

    def request_mlp(self, layers) -> None:
        """MLP input samples and mean activations of `layers` (`mlp(layer)`)."""
        self._mlp_requests.update(layers)

    def request_attention(self, layers, num_experts: int) -> None:
        """The attention-router fit statistics of `layers` for `num_experts` attention experts (`attention(layer)`)."""
        self._attention_requests.update((layer, num_experts) for layer in layers)

    def request_sequence_embeddings(self) -> None:
        self._embeddings_requested = True

    def collect(self) -> None:
        """Record everything requested and not recorded yet, in one pass (nothing to do: no model is loaded)."""
        stats = self.statistics
        mlp = sorted(self._mlp_requests - stats.mlp.keys())
        attention = {}  # one expert count per layer and pass (more only when builds with other counts share a context)
        for layer, experts in sorted(self._attention_requests - self._attention.keys()):
            attention.setdefault(layer, experts)
        embeddings = self._embeddings_requested and stats.sequence_embeddings is None
        if not (mlp or attention or embeddings):
            return
        new = collect_calibration(
            *self._model_and_tokens(),
            mlp,
            attention_experts=attention,
            sequence_embeddings=embeddings,
            max_hidden_samples=self.recipe.calibration_samples,
            batch_size=self.batch_size,
            seed=self.recipe.seed,
            progress=self.progress,
        )
        stats.mlp.update(new.mlp)
        self._attention.update({(layer, attention[layer]): value for layer, value in new.attention.items()})
        if embeddings:
            stats.sequence_embeddings = new.sequence_embeddings
        self.collect()  # attention statistics for a second expert count of the same layer, if any

    # Results ---------------------------------------------------------------------------------------------------

    def mlp(self, layer: int) -> LayerCalibration:
        self.request_mlp([layer])
        self.collect()
        return self.statistics.mlp[layer]

    def attention(self, layer: int, num_experts: int) -> AttentionCalibration:
        self.request_attention([layer], num_experts)
        self.collect()
        return self._attention[layer, num_experts]

    def sequence_embeddings(self) -> torch.Tensor:
        self.request_sequence_embeddings()
        self.collect()
        return self.statistics.sequence_embeddings

    def importance(self, key: str, layers, **groups) -> dict[int, LayerCalibration]:
        """Neuron importance per token group (a gradient pass), cached under `key`; `groups` are
        `collect_calibration`'s `token_groups` / `sequence_groups` and `num_groups`."""
        if key not in self._importance:
            self._importance[key] = collect_calibration(
                *self._model_and_tokens(),
                layers,
                with_gradients=True,
                batch_size=self.batch_size,
                max_hidden_samples=0,
                seed=self.recipe.seed,
                progress=self.progress,
                **groups,
            ).mlp
        return self._importance[key]

    def kmeans_centroids(self, layer: int, num_experts: int) -> torch.Tensor:
        """`[E, H]` balanced k-means centroids of the layer's MLP input sample (routers of LLaMA-MoE v2), cached."""
        if (layer, num_experts) not in self._centroids:
            from .clustering import kmeans_router

            samples = self.mlp(layer).hidden_states
            self._centroids[layer, num_experts] = kmeans_router(samples, num_experts, seed=self.recipe.seed)
        return self._centroids[layer, num_experts]

    def set_kmeans_centroids(self, centroids: dict[int, torch.Tensor]) -> None:
        """Centroids read from a split file instead of computed."""
        self._centroids.update({(layer, c.shape[0]): c for layer, c in centroids.items()})

    def has_kmeans_centroids(self, layers, num_experts: int) -> bool:
        return all((layer, num_experts) in self._centroids for layer in layers)

    # The model and the tokens ----------------------------------------------------------------------------------

    def model(self):
        """The dense model, loaded on first use (on `device`, else CUDA when available; float32 on CPU)."""
        if self._released:
            raise RuntimeError("The dense model was released: request calibration statistics before prepare().")
        if self._model is None:
            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            with transformers_progress_bars(self.progress):
                self._model = self._load_model(torch.float32 if device == "cpu" else None, device)
        return self._model

    def _model_and_tokens(self) -> tuple:
        """(model, calibration tokens), the tokens made first: bad data or a missing tokenizer fails in seconds,
        before the model is loaded."""
        input_ids = self.input_ids
        return self.model(), input_ids

    @property
    def input_ids(self) -> torch.LongTensor:
        """`[B, calibration_seq_len]` calibration tokens, made once from the recipe's calibration data."""
        if self._input_ids is None:
            self._input_ids = self._tokenize(self.recipe.calibration_tokens)
        return self._input_ids

    def tokens(self, num_tokens: int) -> torch.LongTensor:
        """The first `num_tokens` calibration tokens as `[B, calibration_seq_len]` (healing may train on more or
        fewer tokens than the statistics use); given token ids are used as they are."""
        seq_len = self.recipe.calibration_seq_len
        if self.data_description == "given token ids" or num_tokens <= self.recipe.calibration_tokens:
            return self.input_ids[: max(1, num_tokens // seq_len)]
        return self._tokenize(num_tokens)

    def _tokenize(self, num_tokens: int) -> torch.LongTensor:
        r = self.recipe
        texts, self.data_description = load_calibration_texts(
            r.calibration_data,
            max_chars=16 * num_tokens,  # a streamed dataset stops early
        )
        if self._load_tokenizer is None:
            raise ValueError("Calibration text needs a tokenizer; pass one (or calibration token ids).")
        input_ids = tokenize_calibration(texts, self._load_tokenizer(), num_tokens, r.calibration_seq_len)
        num_sequences, seq_len = input_ids.shape
        logger.info("Calibration data: %s -> %d sequences of %d tokens.", self.data_description, num_sequences, seq_len)
        return input_ids

    @property
    def used(self) -> bool:
        """Whether calibration tokens were used (then `conversion_info` records the calibration settings)."""
        return self._input_ids is not None

    def release(self) -> None:
        """Drop the dense model (the statistics stay), so that the streaming write holds about one layer."""
        self._model = None
        self._released = True

"""`batch_similar(options)`: documents in, similarity-ordered packed sequences out (written atomically)."""

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..preflight import check_writable, require
from .options import BatchSimilarOptions

logger = logging.getLogger(__name__)


@dataclass
class BatchSimilarResult:
    output: Path
    documents: int
    sequences: int
    tokens: int
    seconds: dict[str, float]  # per stage


def batch_similar(options: BatchSimilarOptions, texts: list[str] | None = None, tokenizer=None) -> BatchSimilarResult:
    """Embed the documents (`texts`, else read from `options.documents`), chain each to its nearest unvisited
    neighbour, pack the chain into `seq_len` token sequences and write them to `options.output`."""
    from ..text.tokens import document_tokens, pack

    output, fmt = _check(options)
    order_documents = SimilarityOrder(options)  # an unknown embedder or a missing --encoder: one error before any work
    seconds, clock = {}, time.perf_counter()
    texts = _documents(options) if texts is None else texts
    tokenizer = tokenizer or load_tokenizer(options.tokenizer, options.trust_remote_code)

    def lap(stage):
        nonlocal clock
        seconds[stage], clock = time.perf_counter() - clock, time.perf_counter()

    lap("read")
    order = order_documents(texts, lap)
    packed = pack(list(document_tokens(texts, tokenizer, options.progress)), order, options.seq_len)
    lap("tokenize+pack")
    _write(packed, output, fmt, options.overwrite)
    lap("write")
    return BatchSimilarResult(output, len(texts), len(packed), len(packed.tokens), seconds)


class SimilarityOrder:
    """Documents -> their similarity order (a permutation): embed, nearest neighbours, greedy chain."""

    def __init__(self, options: BatchSimilarOptions):
        from .embedders import EMBEDDERS

        if options.search == "faiss":
            require("faiss", "--search faiss")
        self.options, self.embedder = options, EMBEDDERS[options.embedder](options)

    def __call__(self, texts: list[str], lap=lambda stage: None):
        from .chaining import chain_documents
        from .neighbours import nearest_neighbours

        options = self.options
        embeddings = self.embedder.embed(texts)
        lap("embed")
        neighbours = nearest_neighbours(embeddings, options.neighbours, options.search, options.exact_search_limit)
        lap("neighbours")
        order = chain_documents(neighbours, seed=options.seed, progress=options.progress)
        lap("chain")
        return order


def _check(options: BatchSimilarOptions) -> tuple[Path, str]:
    if not options.output:
        raise ValueError("--output is required (a datasets folder, or a .jsonl file).")
    for name in ("neighbours", "seq_len", "embedding_dim", "encoder_batch_size"):
        if getattr(options, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(options, name)}.")
    output = Path(options.output).expanduser()
    if output.exists() and not options.overwrite:
        raise FileExistsError(f"{output} exists; pass --overwrite to replace it.")
    check_writable(output, "--output")
    return output, options.format or ("jsonl" if output.suffix == ".jsonl" else "datasets")


def _documents(options: BatchSimilarOptions) -> list[str]:
    from ..text.documents import load_texts

    texts, description = load_texts(
        options.documents, text_column=options.text_field, split=options.split, what="Documents"
    )
    logger.info("Documents: %s.", description)
    if len(texts) < 2:
        raise ValueError(f"Need at least 2 documents to order by similarity, got {len(texts)}.")
    return texts


def load_tokenizer(name: str | None, trust_remote_code: bool = False):
    """The tokenizer of a folder or Hub id; None: the built-in default model's."""
    from ..checkpoints.folder import read_tokenizer

    if name is None:
        from ..checkpoints import default_model_path

        return read_tokenizer(default_model_path())
    return read_tokenizer(name, trust_remote_code=trust_remote_code)


def _write(packed, output: Path, fmt: str, overwrite: bool) -> None:
    """Written next to `output` under a temporary name, renamed into place when complete."""
    from ..checkpoints.atomic import atomic_file, atomic_folder

    if fmt == "datasets":
        from datasets import Dataset

        with atomic_folder(output) as tmp:
            Dataset(packed.to_arrow()).save_to_disk(str(tmp))
        return
    if output.is_dir():
        raise IsADirectoryError(f"{output} is a folder; JSON lines output needs a file name.")
    with atomic_file(output) as tmp, open(tmp, "w", encoding="utf-8") as file:
        for row in packed.rows():
            file.write(json.dumps(row) + "\n")

"""Options of `batch_similar` / `llama-moe batch-similar` (no heavy imports: the command line reads them first)."""

import dataclasses

OUTPUT_FORMATS = ("datasets", "jsonl")
SEARCHES = ("auto", "faiss", "sklearn")


@dataclasses.dataclass(frozen=True)
class BatchSimilarOptions:
    output: str = dataclasses.field(
        default=None, metadata={"help": "output: a datasets folder, or a .jsonl file (one packed sequence per line)"}
    )
    documents: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "documents: .jsonl/.json/.parquet (one per row), .txt/.md (one per file), a folder of those, or "
            "a datasets name (default: the built-in corpus)"
        },
    )
    text_field: str | None = dataclasses.field(default=None, metadata={"help": "field of the text (default: text)"})
    split: str = dataclasses.field(default="train", metadata={"help": "split of a datasets name"})
    embedder: str = dataclasses.field(default="tfidf", metadata={"help": "how documents are embedded"})
    encoder: str | None = dataclasses.field(
        default=None, metadata={"help": "model of the sentence-transformers or transformers embedder"}
    )
    embedding_dim: int = dataclasses.field(default=128, metadata={"help": "dimensions of the TF-IDF + SVD embedding"})
    encoder_batch_size: int = dataclasses.field(default=64, metadata={"help": "documents per encoder batch"})
    neighbours: int = dataclasses.field(default=10, metadata={"help": "nearest neighbours kept per document"})
    search: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "nearest-neighbour search: faiss, sklearn, or auto (faiss when installed)",
            "choices": SEARCHES,
        },
    )
    exact_search_limit: int = dataclasses.field(
        default=100_000,
        metadata={"help": "up to this many documents faiss searches exactly; above, an IVF index (approximate)"},
    )
    tokenizer: str | None = dataclasses.field(
        default=None, metadata={"help": "tokenizer folder or Hub id (default: the built-in model's)"}
    )
    seq_len: int = dataclasses.field(default=2048, metadata={"help": "tokens per packed sequence"})
    format: str | None = dataclasses.field(
        default=None,
        metadata={"help": "datasets or jsonl (default: jsonl for a .jsonl output)", "choices": OUTPUT_FORMATS},
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the SVD and of where chains start"})
    overwrite: bool = dataclasses.field(default=False, metadata={"help": "replace an existing output"})
    trust_remote_code: bool = dataclasses.field(default=False, metadata={"help": "allow an encoder's remote code"})
    progress: bool = dataclasses.field(default=True, metadata={"help": "show progress bars"})

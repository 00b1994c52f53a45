"""`llama-moe analyze`'s options (light: the command line reads them before anything heavy is imported)."""

from dataclasses import dataclass, field

BUILT_IN_DOMAIN = "stdlib-docstrings"  # the built-in corpus, when no --data is given


@dataclass
class AnalyzeOptions:
    output: str = field(metadata={"help": "folder to write: analysis.json, PNG plots, summary.md (atomically)"})
    data: list[str] = field(
        default_factory=list,
        metadata={
            "help": "domains as NAME=PATH: a .txt/.md/.json/.jsonl/.parquet file or folder, or a datasets name "
            "(NAME or NAME:CONFIG); default: the built-in corpus (Python docstrings) as one domain"
        },
    )
    max_tokens: int = field(default=16384, metadata={"help": "tokens read from each domain (at most)"})
    seq_len: int = field(default=512, metadata={"help": "tokens per sequence"})
    batch_size: int = field(default=4, metadata={"help": "sequences per forward"})
    similarity_tokens: int = field(
        default=2048, metadata={"help": "tokens every expert is run on for the output similarity, per layer"}
    )
    text_column: str | None = field(default=None, metadata={"help": "field holding the text in json/parquet rows"})
    dtype: str = field(default="auto", metadata={"help": "auto (the checkpoint's), float32, bfloat16 or float16"})
    device: str | None = field(default=None, metadata={"help": "torch device (default: cuda if available, else cpu)"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output folder"})

    def domains(self) -> dict[str, str | None]:
        from ..training.mixture import parse_pairs

        if self.seq_len < 2 or self.max_tokens < self.seq_len or self.batch_size < 1 or self.similarity_tokens < 0:
            raise ValueError(
                "need --seq-len >= 2, --max-tokens >= --seq-len, --batch-size >= 1, --similarity-tokens >= 0."
            )
        return parse_pairs(self.data, "--data") or {BUILT_IN_DOMAIN: None}

"""`llama-moe eval`'s options (light: the command line reads them before anything heavy is imported)."""

from dataclasses import dataclass, field
from pathlib import Path

from ..hub.card import RESULTS_FILE  # in a model folder, `llama-moe push` puts it into the card's metadata


@dataclass
class EvalOptions:
    data: list[str] = field(
        default_factory=list,
        metadata={
            "help": "text to measure perplexity on, PATH or NAME=PATH: a .txt/.md/.json/.jsonl/.parquet file or "
            "folder, or a datasets name (NAME or NAME:CONFIG); default: the built-in corpus (Python docstrings, "
            "which conversions also calibrate on by default)"
        },
    )
    max_tokens: int = field(default=32768, metadata={"help": "tokens read from each source (at most)"})
    window: int = field(default=1024, metadata={"help": "tokens per forward (at most the model's context)"})
    stride: int | None = field(default=None, metadata={"help": "tokens the window moves by (default: window / 2)"})
    batch_size: int = field(default=4, metadata={"help": "windows per forward; lm-eval's batch size"})
    tasks: list[str] = field(
        default_factory=list,
        metadata={"help": "lm-eval tasks (needs the eval extra), e.g. llama_moe_arithmetic (local, offline)"},
    )
    limit: int | None = field(default=None, metadata={"help": "lm-eval: examples per task (default: all)"})
    num_fewshot: int | None = field(default=None, metadata={"help": "lm-eval: few-shot examples"})
    text_column: str | None = field(default=None, metadata={"help": "field holding the text in json/parquet rows"})
    dtype: str = field(default="auto", metadata={"help": "auto (the checkpoint's), float32, bfloat16 or float16"})
    device: str | None = field(default=None, metadata={"help": "torch device (default: cuda if available, else cpu)"})
    output: str | None = field(
        default=None,
        metadata={"help": f"results file (default: {RESULTS_FILE} in a local model folder, else in the current one)"},
    )

    def sources(self) -> dict[str, str | None]:
        from ..training.mixture import parse_pairs

        plain = [spec for spec in self.data if "=" not in spec]
        named = parse_pairs([spec for spec in self.data if "=" in spec], "--data")
        return {Path(spec).name or spec: spec for spec in plain} | named or {"stdlib-docstrings": None}

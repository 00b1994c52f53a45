"""The check `llama-moe convert` runs on what it wrote: perplexity of the MoE model next to the dense model's, on
held-out built-in text, so a conversion that needs training before use says so at once (`--no-eval` skips it)."""

from dataclasses import dataclass
from pathlib import Path

import torch

QUICK_TOKENS = 512
QUICK_WINDOW = 256
MAX_PARAMETERS = 1_500_000_000  # larger models: loading the MoE whole is no quick check; `llama-moe eval` does it
# Verdicts by the ratio to the dense perplexity. A random split without training lands at thousands of times the
# dense perplexity (gibberish); G-MoEfication at 6 of 8 experts at about 1.5x (docs/quality.md) and still answers.
CLOSE_RATIO = 1.1
NEEDS_TRAINING_RATIO = 3.0


@dataclass
class QuickCheck:
    perplexity: float
    dense_perplexity: float
    tokens: int

    @property
    def ratio(self) -> float:
        return self.perplexity / self.dense_perplexity

    @property
    def needs_training(self) -> bool:
        return self.ratio > NEEDS_TRAINING_RATIO

    def describe(self) -> str:
        if self.needs_training:
            verdict = "it needs training before use (docs/training.md)"
        elif self.ratio > CLOSE_RATIO:
            verdict = "usable, below the dense model; training recovers the rest (docs/training.md)"
        else:
            verdict = "as good as the dense model"
        return (
            f"perplexity on {self.tokens:,} held-out tokens of built-in text: {self.perplexity:.2f} against the dense "
            f"model's {self.dense_perplexity:.2f} ({self.ratio:.2f}x): {verdict}"
        )


def held_out_tokens(tokenizer, count: int = QUICK_TOKENS) -> torch.Tensor:
    """The last documents of the built-in corpus: calibration reads it from the start, so these are not its data."""
    from ..text.corpus import stdlib_docstrings
    from ..text.tokens import token_stream

    return token_stream(reversed(stdlib_docstrings()), tokenizer, count)


@torch.inference_mode()
def quick_check(folder: Path, source, tokenizer, device: str | None = None) -> QuickCheck:
    """Perplexity of the MoE model in `folder` and of the dense `source` (a conversion source) on the same tokens."""
    from transformers import AutoModelForCausalLM

    from ..perplexity import sliding_window_perplexity

    tokens = held_out_tokens(tokenizer)
    loaders = (
        lambda: source.load_model(dtype=torch.float32, device=device),
        lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device or "cpu"),
    )
    scores = []
    for load in loaders:
        model = load().eval()  # one model in memory at a time
        scores.append(sliding_window_perplexity(model, tokens, QUICK_WINDOW, QUICK_WINDOW))
        del model
    dense, moe = scores
    return QuickCheck(moe.perplexity, dense.perplexity, moe.tokens)

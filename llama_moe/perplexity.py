"""Perplexity over a token stream with a sliding window: every token after the first is scored exactly once, with up
to `window - stride` tokens of context carried over from the previous window (the transformers perplexity guide's
scheme, with exact token accounting)."""

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Perplexity:
    nll: float  # summed negative log-likelihood, nats
    tokens: int  # tokens scored
    forwarded: int  # tokens run through the model (scored + context)
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    def as_dict(self) -> dict:
        return {
            "perplexity": self.perplexity,
            "mean_nll": self.nll / self.tokens,
            "tokens": self.tokens,
            "tokens_per_second": self.forwarded / self.seconds if self.seconds else None,
        }


def windows(length: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over `length` tokens."""
    if not 1 <= stride <= window or window < 2:
        raise ValueError(f"need 1 <= --stride <= --window and --window >= 2, got window {window}, stride {stride}.")
    spans, scored_until = [], 1  # position 0 has no context: never scored
    for begin in range(0, length - 1, stride):
        end = min(begin + window, length)
        spans.append((begin, end, max(scored_until, begin + 1)))
        scored_until = end
        if end == length:
            break
    return spans


@torch.inference_mode()
def sliding_window_perplexity(model, tokens: torch.Tensor, window: int, stride: int, batch_size: int = 1, bar=None):
    """`tokens` `[N]` -> `Perplexity`; windows of equal length go through the model `batch_size` at a time."""
    spans = windows(tokens.numel(), window, stride)
    nll, scored, start = 0.0, 0, time.perf_counter()
    for group in _batches(spans, batch_size):
        ids = torch.stack([tokens[begin:end] for begin, end, _ in group]).to(model.device)  # [b, L]
        logits = model(input_ids=ids, use_cache=False).logits.float()  # [b, L, V]
        for row, (begin, end, first) in enumerate(group):
            predicted = logits[row, first - begin - 1 : end - begin - 1]  # position p is predicted at p - 1
            nll += F.cross_entropy(predicted, ids[row, first - begin : end - begin], reduction="sum").item()
            scored += end - first
        if bar is not None:
            bar.update(sum(end - first for _, end, first in group))
    forwarded = sum(end - begin for begin, end, _ in spans)
    return Perplexity(nll, scored, forwarded, time.perf_counter() - start)


def _batches(spans, batch_size: int):
    """Consecutive windows of the same length, at most `batch_size` together."""
    group = []
    for span in spans:
        if group and (len(group) == batch_size or span[1] - span[0] != group[0][1] - group[0][0]):
            yield group
            group = []
        group.append(span)
    if group:
        yield group

"""The check `llama-moe convert` (and `merge`, `export`) runs on what it wrote: how much of the dense model's
behaviour the output kept, on what no conversion calibrates on (`--no-eval` skips it).

- answers (instruct models): the 24 prompts of `text.prompts` "check" split, greedy, next to the dense model's
  (`behaviour`): how many begin as its answers (first 12 tokens), the KL over its answers, and the
  checkable ones' accuracy;
- text: 512 tokens of the licence texts the installed Python packages carry (legal prose, no built-in calibration
  corpus's domain): KL to the dense model, the share of positions predicting its next token, perplexity;
- in the dtype the folder is written in; a bfloat16 or float16 folder's answers are also compared with its float32
  twin's, so a rounding that changes answers is said, and the verdict reads the twin's (the conversion's own).

"As good as the dense model" only within the noise of rounding the dense weights to bfloat16 (docs/quality.md).
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

QUICK_TOKENS = 512
QUICK_WINDOW = 256
MAX_PARAMETERS = 1_500_000_000  # larger models: loading the MoE whole is no quick check; `llama-moe eval` does it
TEXT_NAME = "licences"
TEXT_DESCRIPTION = "licence texts of the installed Python packages"
# Within noise: the README's upcycle saved in bfloat16 (the dense weights rounded) keeps 23 of the 24 check answers
# in float32 (20 computed in bfloat16) at a KL of 0.002 a token on this text; the dense weights rounded keep 96.7% of
# 214 held-out answers (docs/quality.md, "What a converted model keeps of its source").
CLOSE_MATCH = 0.9
CLOSE_KL = 0.02
NEEDS_TRAINING_RATIO = 3.0  # a random split without training lands at thousands of times the dense perplexity


@dataclass
class QuickCheck:
    scores: dict  # `behaviour.Scores.as_dict()` of the output
    dtype: str = "float32"
    rounding_changed: int | None = None  # answers that differ from the float32 twin's (a 16-bit folder)
    float32_match: float | None = None  # the float32 twin's share of answers beginning as the dense model's
    reference: str = "the dense model"  # what it was checked against (an export: its source folder)

    @property
    def perplexity(self) -> float:
        return self.scores[f"{TEXT_NAME}_perplexity"]

    @property
    def dense_perplexity(self) -> float:
        return self.scores[f"{TEXT_NAME}_dense_perplexity"]

    @property
    def ratio(self) -> float:
        return self.perplexity / self.dense_perplexity

    @property
    def kl(self) -> float:
        return self.scores[f"{TEXT_NAME}_kl"]

    @property
    def match(self) -> float | None:
        return self.scores.get("answers_match_12")

    @property
    def needs_training(self) -> bool:
        return self.ratio > NEEDS_TRAINING_RATIO

    @property
    def close(self) -> bool:
        """Within noise: a 16-bit folder's answers are judged by its float32 twin's (computing in bfloat16 moves
        close calls: the README's upcycle saved in bfloat16 keeps 20 of 24 answers computed in bfloat16, 23 in
        float32), its rounding said apart (`rounding_changed`)."""
        match = max(self.match, self.float32_match or 0.0) if self.match is not None else None
        return self.kl <= CLOSE_KL and (match is None or match >= CLOSE_MATCH)

    def verdict(self) -> str:
        if self.needs_training:
            return "it needs training before use (docs/training.md)"
        if self.close:
            return f"as good as {self.reference} (within the noise of rounding its weights to bfloat16)"
        return f"below {self.reference}: heal it further or train it (docs/training.md)"

    def lines(self) -> list[str]:
        s, lines = self.scores, []
        if self.match is not None:
            n = s["prompts"]
            lines.append(
                f"answers to {n} check prompts ({self.dtype}): {round(self.match * n)} of {n} begin as "
                f"{self.reference}'s (first 12 tokens), {round(s['answers_whole'] * n)} whole; KL over its answers "
                f"{s['answer_kl']:.3f} a token; checkable answers right {_share(s['accuracy'])} "
                f"(dense {_share(s['dense_accuracy'])})"
            )
        if self.rounding_changed:
            twin = round(self.float32_match * s["prompts"])
            lines.append(
                f"warning: in {self.dtype}, {self.rounding_changed} of {s['prompts']} answers differ from the "
                f"float32 weights' ({twin} of {s['prompts']} begin as {self.reference}'s in float32: rounding moved "
                "close calls; --dtype float32 keeps them)"
            )
        lines.append(
            f"{s[f'{TEXT_NAME}_tokens']} tokens of {TEXT_DESCRIPTION}: KL to {self.reference} {self.kl:.3f} a "
            f"token, its next token at {_share(s[f'{TEXT_NAME}_agreement'])} of positions, perplexity "
            f"{self.perplexity:.2f} against {self.dense_perplexity:.2f} ({self.ratio:.2f}x)"
        )
        return lines + [f"verdict: {self.verdict()}"]

    def describe(self) -> str:
        return "; ".join(self.lines())


def _share(value) -> str:
    return "n/a" if value is None else f"{value:.0%}"


@functools.cache  # read once per process (a test session converts many times)
def licence_texts() -> tuple[str, ...]:
    """The licence files of the installed distributions, each once, by distribution name (torch and transformers,
    which every install has, carry several)."""
    import importlib.metadata

    found = {}
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        for file in dist.files or []:
            if "dist-info" in str(file) and file.name.upper().startswith(("LICENSE", "LICENCE", "COPYING")):
                try:
                    text = Path(file.locate()).read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                found.setdefault(text.strip(), None)
    return tuple(text for text in found if text)


def held_out_rows(tokenizer, count: int = QUICK_TOKENS, window: int = QUICK_WINDOW) -> torch.Tensor:
    """`[count // window, window]` tokens of the installed packages' licences."""
    from ..text.tokens import token_stream

    tokens = token_stream(licence_texts(), tokenizer, count)
    return tokens[: len(tokens) // window * window].view(-1, window)


@torch.inference_mode()
def quick_check(folder: Path, load_dense, tokenizer, device=None, reference: str = "the dense model") -> QuickCheck:
    """The output in `folder` against the model `load_dense(dtype, device)` gives (`reference` names it), one model in
    memory at a time."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

    from .. import behaviour
    from ..text.prompts import prompts

    device = device or "cpu"
    dense = load_dense(torch.float32, device)
    dense_side = behaviour.dense_reference(dense, tokenizer, prompts("check"), {TEXT_NAME: held_out_rows(tokenizer)})
    del dense
    dtype = AutoConfig.from_pretrained(folder).dtype or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    scores = behaviour.score(model, dense_side)
    del model
    changed = twin_match = None
    if dtype != torch.float32 and dense_side.prompts:
        twin = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        twin_answers = behaviour.greedy_answers(twin, dense_side.prompt_ids, dense_side.eos)
        changed = sum(not torch.equal(a, b) for a, b in zip(scores.answers, twin_answers))
        found = behaviour.matches(twin_answers, dense_side.answers)
        twin_match = sum(found) / len(found)
    numbers = scores.as_dict() | {f"{TEXT_NAME}_tokens": dense_side.texts[TEXT_NAME][0].numel()}
    dtype_name = str(dtype).removeprefix("torch.")
    return QuickCheck(numbers, dtype_name, changed, twin_match, reference=reference)

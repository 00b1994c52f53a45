"""What a converted model keeps of its source's behaviour: its answers to chat prompts and its next-token
distributions on text, scored against the dense model's.

    reference = dense_reference(dense, tokenizer, prompts("check"), {"licences": ids})   the dense model, once
    scores = score(model, reference)                                                     any model, against it
    scores.as_dict()  ->  answers_match_12, answers_whole, answer_kl, accuracy_share, {text}_kl, {text}_agreement, ...

Answers (instruct models, `tokenizer.chat_template` set): each prompt as one user turn, greedy, `max_new_tokens`.
- match_12: the model's answer begins as the dense one, in its first 12 tokens (all of it, end included, when shorter)
- whole: the whole answer is the dense one; prefix: the share of the dense answer's tokens matched before the first
  difference
- answer_kl: mean KL(dense || model) per token over the dense model's own answers (teacher forcing), what
  sequence-level distillation lowers
- accuracy: where a prompt has an answer to check (`Prompt.answer`), the model's correct share next to dense's
Text: KL(dense || model) per token, the share of positions where both predict the same next token, perplexity.

Sequences are batched with others of similar lengths, padded (on the left, masked, for generation): the dense model
and every model scored against it see the same batches.
The dense model's log-probabilities are kept in float16 (`[tokens, vocab]`), so a model is scored alone in memory.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MATCH_TOKENS = 12
MAX_NEW_TOKENS = 32
BATCH = 8


@dataclass
class Reference:
    """The dense model's side: prompt ids, its answers and log-probabilities over them, its text log-probabilities."""

    prompts: list
    prompt_ids: list[torch.Tensor] = field(default_factory=list)  # [P] each, chat-formatted
    answers: list[torch.Tensor] = field(default_factory=list)  # [A] each, the end token included when it stopped
    answer_logprobs: list[torch.Tensor] = field(default_factory=list)  # [A, V] float16
    dense_correct: list = field(default_factory=list)  # bool or None per prompt
    texts: dict = field(default_factory=dict)  # name -> (rows [n, L], logprobs [n, L - 1, V] float16)
    eos: tuple[int, ...] = ()
    decode: object = None  # token ids -> text (the tokenizer's)


@dataclass
class Scores:
    answers: list[torch.Tensor]
    match_12: list[bool]
    whole: list[bool]
    prefix: list[float]
    answer_kl: float | None
    correct: list
    dense_correct: list
    texts: dict  # name -> {"kl", "agreement", "perplexity", "dense_perplexity"}
    kinds: list[str]

    def as_dict(self) -> dict:
        out = {}
        if self.match_12:
            checked = [(c, d) for c, d in zip(self.correct, self.dense_correct) if c is not None]
            dense_right = sum(d for _, d in checked)
            out |= {
                "prompts": len(self.match_12),
                "answers_match_12": _mean(self.match_12),
                "answers_whole": _mean(self.whole),
                "answer_prefix": _mean(self.prefix),
                "answer_kl": self.answer_kl,
                "accuracy": _mean([c for c, _ in checked]),
                "dense_accuracy": _mean([d for _, d in checked]),
                "accuracy_share": sum(c for c, _ in checked) / dense_right if dense_right else None,
            }
        for name, values in self.texts.items():
            out |= {f"{name}_{key}": value for key, value in values.items()}
        return out

    def by_kind(self) -> dict:
        """{kind: (prompts, share matching in 12 tokens)}."""
        kinds = {}
        for kind, match in zip(self.kinds, self.match_12):
            kinds.setdefault(kind, []).append(match)
        return {kind: (len(v), _mean(v)) for kind, v in kinds.items()}


def _mean(values):
    return sum(values) / len(values) if values else None


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    """`[P]` ids of `text` as one user turn with the generation prompt, as `llama-moe chat` sends it."""
    messages = [{"role": "user", "content": text}]
    return torch.tensor(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    )


def end_tokens(model, tokenizer) -> tuple[int, ...]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return tuple(dict.fromkeys([*ids, tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else ids))


def _length_batches(lengths: list[int], batch: int = BATCH):
    """Index lists of at most `batch` sequences of similar lengths (sorted), so that padding stays short."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for start in range(0, len(order), batch):
        yield order[start : start + batch]


def padded(sequences: list[torch.Tensor], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`[b, L]` ids padded to the longest (on the left for generation) and the attention mask."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        span = slice(longest - len(seq), longest) if left else slice(0, len(seq))
        ids[row, span], mask[row, span] = seq, 1
    return ids, mask


@torch.inference_mode()
def greedy_answers(model, prompt_ids: list[torch.Tensor], eos, max_new_tokens: int = MAX_NEW_TOKENS, batch=BATCH):
    """Each prompt's greedy answer `[A]`, cut after its first end token (`batch` prompts of similar lengths at a time,
    padded on the left)."""
    answers = [None] * len(prompt_ids)
    for group in _length_batches([len(p) for p in prompt_ids], batch):
        ids, mask = padded([prompt_ids[i] for i in group], eos[0], left=True)
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=eos[0],
            eos_token_id=list(eos),
        )[:, ids.shape[1] :].cpu()
        for row, index in enumerate(group):
            answers[index] = _cut_at_end(out[row], eos)
    return answers


def _cut_at_end(tokens: torch.Tensor, eos) -> torch.Tensor:
    ends = torch.isin(tokens, torch.tensor(eos)).nonzero()
    return tokens[: int(ends[0]) + 1] if len(ends) else tokens


@torch.inference_mode()
def _logprobs(model, sequences: list[torch.Tensor], starts: list[int]) -> list[torch.Tensor]:
    """For each sequence, `[len - start, V]` log-probabilities of the tokens from `start` on (float32). Padded on
    the right: a causal model's positions never see what follows them, so no mask is needed."""
    result = [None] * len(sequences)
    for group in _length_batches([len(s) for s in sequences]):
        ids, _ = padded([sequences[i] for i in group], 0, left=False)
        logits = model(input_ids=ids.to(model.device), use_cache=False).logits.float()
        for row, index in enumerate(group):
            length = len(sequences[index])
            result[index] = F.log_softmax(logits[row, starts[index] - 1 : length - 1], dim=-1).cpu()
    return result


def dense_reference(dense, tokenizer, prompts, texts: dict, max_new_tokens: int = MAX_NEW_TOKENS) -> Reference:
    """The dense model's answers to `prompts` (none without a chat template) and its log-probabilities on `texts`
    ({name: `[n, L]` rows of token ids})."""
    dense.eval()
    reference = Reference(prompts if tokenizer.chat_template else [], eos=end_tokens(dense, tokenizer))
    reference.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    reference.prompt_ids = [chat_ids(tokenizer, p.text) for p in reference.prompts]
    reference.answers = greedy_answers(dense, reference.prompt_ids, reference.eos, max_new_tokens)
    logprobs = _logprobs(dense, *_answer_sequences(reference))
    reference.answer_logprobs = [lp.half() for lp in logprobs]
    reference.dense_correct = [p.correct(reference.decode(a)) for p, a in zip(reference.prompts, reference.answers)]
    for name, rows in texts.items():
        rows_logprobs = _logprobs(dense, list(rows), [1] * len(rows))
        reference.texts[name] = (rows, torch.stack(rows_logprobs).half())
    return reference


def _answer_sequences(reference: Reference) -> tuple[list, list]:
    sequences = [torch.cat([p, a]) for p, a in zip(reference.prompt_ids, reference.answers)]
    return sequences, [len(p) for p in reference.prompt_ids]


def _kl(dense_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Per-position KL(dense || model) from `[..., V]` log-probabilities."""
    dense_logprobs = dense_logprobs.float()
    return (dense_logprobs.exp() * (dense_logprobs - logprobs)).sum(-1)


def score(model, reference: Reference, max_new_tokens: int = MAX_NEW_TOKENS) -> Scores:
    """`model`'s answers and text distributions against the dense `reference`."""
    model.eval()
    answers = greedy_answers(model, reference.prompt_ids, reference.eos, max_new_tokens)
    match = matches(answers, reference.answers)
    whole = [torch.equal(answer, dense) for answer, dense in zip(answers, reference.answers)]
    prefix = [_common_prefix(a, d) / max(1, len(d)) for a, d in zip(answers, reference.answers)]
    correct = [p.correct(reference.decode(a)) for p, a in zip(reference.prompts, answers)]
    kinds = [p.kind for p in reference.prompts]
    kl = answer_kl(model, reference)
    return Scores(
        answers, match, whole, prefix, kl, correct, reference.dense_correct, text_scores(model, reference), kinds
    )


def answer_kl(model, reference: Reference) -> float | None:
    """Mean KL(dense || model) per token over the dense model's answers, teacher-forced (None without answers)."""
    kl_sum, kl_tokens = 0.0, 0
    for dense_lp, lp in zip(reference.answer_logprobs, _logprobs(model, *_answer_sequences(reference))):
        kl_sum, kl_tokens = kl_sum + _kl(dense_lp, lp).sum().item(), kl_tokens + len(lp)
    return kl_sum / kl_tokens if kl_tokens else None


def text_scores(model, reference: Reference) -> dict:
    """{text: {"kl", "agreement", "perplexity", "dense_perplexity"}} on the reference's texts."""
    return {name: _text_scores(model, rows, dense_lp) for name, (rows, dense_lp) in reference.texts.items()}


def matches(answers, dense_answers) -> list[bool]:
    """Whether each answer begins as the dense one: its first `MATCH_TOKENS` tokens, all of it when shorter."""
    found = []
    for answer, dense in zip(answers, dense_answers):
        n = min(MATCH_TOKENS, len(dense))
        found.append(len(answer) >= n and torch.equal(answer[:n], dense[:n]))
    return found


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def _text_scores(model, rows: torch.Tensor, dense_logprobs: torch.Tensor) -> dict:
    logprobs = torch.stack(_logprobs(model, list(rows), [1] * len(rows)))  # [n, L - 1, V]
    targets = rows[:, 1:].unsqueeze(-1)
    nll = -logprobs.gather(-1, targets).mean().item()
    dense_nll = -dense_logprobs.float().gather(-1, targets).mean().item()
    return {
        "kl": _kl(dense_logprobs, logprobs).mean().item(),
        "agreement": (logprobs.argmax(-1) == dense_logprobs.argmax(-1)).float().mean().item(),
        "perplexity": math.exp(nll),
        "dense_perplexity": math.exp(dense_nll),
    }

"""Calibration and healing text made by the dense model itself: `builtin:chat`, `builtin:self` and their mixes.

- `builtin:chat` (`SelfDistilledChats`): each document one conversation, a prompt of `text.prompts`' calibration split
  (never a held-out one) as a user turn and the dense model's own greedy answer as the assistant's, rendered with the
  tokenizer's chat template. Healing towards the dense model on them is sequence-level self-distillation (as
  MiniLLM, GKD and DistiLLM train on the teacher's outputs): the converted model learns what its source does where
  its users meet it. A model without a chat template has no chat format: `builtin:mixed` stands in (logged).
- `builtin:self` (`SelfSampledText`): text the dense model writes from its start token alone, sampled at temperature
  1, as LLM-QAT distils without data: prose of whatever domains the model knows, in its own distribution, for base
  models too.
- `builtin:chat-mixed` / `builtin:chat-self`: the conversations with a document of `builtin:mixed` / a sampled text
  after each (`in_turn`).

What was made is kept in the cache (`LLAMA_MOE_HF_CACHE`/chat, one file per model and kind: a fingerprint of its
weights, dtype and chat template), so that a second conversion of the same model (another preset, another setting)
makes only what no earlier one reached (on SmolLM2-135M the answers took 4.7 of `sparse-50`'s 16 minutes).

    chats = SelfDistilledChats(model, tokenizer, cache=folder)
    chats.texts(num_tokens)      the first conversations, at least `num_tokens` tokens of them, made once
    in_turn(first, second)       one of each in turn
"""

import hashlib
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

TEXT_CHARS = 600  # a mixed-corpus document cut to about a conversation's length, in turn with them
ANSWER_TOKENS = 96  # the answers' limit: longer than the check's 32, so that whole answers are healed on
SAMPLE_TOKENS = 160  # a sampled text: about a conversation's length
MAX_SAMPLES = 4096
BATCH = 32  # rows made together: decoding a 135M model on a CPU is bound by per-step overhead
SEED = 0
MIXED_WITH = {"mixed": "builtin:mixed's documents", "self": "texts the dense model sampled from its start token"}


class SelfMade:
    """Texts the dense model makes, batch after batch as more tokens are asked for, in a fixed order (the first ones
    are the same whatever is asked later), read back from the cache as far as it goes. A kind says how a batch is
    made (`_make`), what a cached row turns into (`_text`) and whether a cached row still applies (`_valid`)."""

    kind = ""  # the cache file's suffix and the description's name
    limit = 0  # the most rows there are

    def __init__(self, model, tokenizer, progress: bool = True, cache: Path | None = None):
        self.model, self.tokenizer, self.progress = model, tokenizer, progress
        self._texts: list[str] = []
        self.rows: list[dict] = []  # what the cache keeps of each text
        self._tokens = 0
        self._cache = cache / f"{fingerprint(model, tokenizer)}-{self.kind}.jsonl" if cache is not None else None
        self._cached = self._read_cache()

    def texts(self, num_tokens: int, count: int = 0) -> list[str]:
        """The first texts: at least `num_tokens` tokens and `count` texts of them (all there are, at most)."""
        from tqdm.auto import tqdm

        by_count = count > 0 and not num_tokens  # the bar counts what is asked for: texts or tokens
        goal, made = (count, lambda: len(self._texts)) if by_count else (num_tokens, lambda: self._tokens)
        unit = "text" if by_count else "token"
        bar = tqdm(desc=self.progress_label, unit=unit, total=goal, disable=not self.progress)
        bar.update(min(made(), goal))
        while (self._tokens < num_tokens or len(self._texts) < count) and len(self._texts) < self.limit:
            before, done = made(), len(self._texts)
            for row in self._cached[done : done + BATCH] if done < len(self._cached) else self._make(done):
                self._add(row)
            bar.update(min(made(), goal) - min(before, goal))
        bar.close()
        self._write_cache()
        if self._tokens < num_tokens:
            logger.warning("The %s texts ran out at %d tokens (%d asked for).", self.kind, self._tokens, num_tokens)
        return list(self._texts)

    def _add(self, row: dict) -> None:
        text = self._text(row)
        self._texts.append(text)
        self.rows.append(row)
        self._tokens += len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _valid(self, index: int, row: dict) -> bool:
        """Whether the cached row `index` is still what this kind would make (a kind whose inputs can change says)."""
        return True

    def _read_cache(self) -> list[dict]:
        if self._cache is None or not self._cache.is_file():
            return []
        rows = [json.loads(line) for line in self._cache.read_text().splitlines()][: self.limit]
        valid = next((i for i, row in enumerate(rows) if not self._valid(i, row)), len(rows))
        return rows[:valid]  # past a row that no longer applies (another version of the prompts), made again

    def _write_cache(self) -> None:
        if self._cache is None or len(self.rows) <= len(self._cached):
            return
        from ..checkpoints.atomic import atomic_file

        self._cache.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(self._cache) as tmp:
            tmp.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
        self._cached = list(self.rows)


class SelfDistilledChats(SelfMade):
    """`builtin:chat`: the calibration prompts and the dense model's greedy answers, rendered as conversations."""

    kind, progress_label = "chat", "Answering calibration prompts"

    def __init__(self, model, tokenizer, progress: bool = True, cache: Path | None = None):
        from .prompts import prompts

        self._prompts = prompts("calibration")
        self.limit = len(self._prompts)
        super().__init__(model, tokenizer, progress, cache)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """(prompt, answer) of each conversation made so far."""
        return [(row["prompt"], row["reply"]) for row in self.rows]

    def description(self, mixed: str = "") -> str:
        """What `conversion_info["calibration_data"]` records; it begins `built-in corpus NAME` as every built-in
        corpus's does (`recipe.preset_measurements` reads it); `mixed`: what comes in turn with the conversations."""
        text = (
            f"built-in corpus {self.kind}{'-' + mixed if mixed else ''}: {len(self._texts)} calibration prompts with "
            f"the dense model's greedy answers (at most {ANSWER_TOKENS} tokens), in its chat template"
        )
        return text + (f", in turn with {MIXED_WITH[mixed]}" if mixed else "")

    def _valid(self, index: int, row: dict) -> bool:
        return row["prompt"] == self._prompts[index].text

    def _text(self, row: dict) -> str:
        turns = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["reply"]}]
        return self.tokenizer.apply_chat_template(turns, tokenize=False)

    def _make(self, start: int) -> list[dict]:
        from ..behaviour import chat_ids, end_tokens, greedy_answers

        tok, batch = self.tokenizer, self._prompts[start : start + BATCH]
        prompt_ids = [chat_ids(tok, p.text) for p in batch]
        answers = greedy_answers(self.model, prompt_ids, end_tokens(self.model, tok), ANSWER_TOKENS, batch=BATCH)
        return [
            {"prompt": p.text, "reply": tok.decode(answer, skip_special_tokens=True).strip()}
            for p, answer in zip(batch, answers)
        ]


class SelfSampledText(SelfMade):
    """`builtin:self`: what the dense model writes after its start token, sampled (seeded by the batch's place, so the
    same model writes the same texts)."""

    kind, progress_label, limit = "self", "Sampling text from the dense model", MAX_SAMPLES

    def description(self) -> str:
        return (
            f"built-in corpus {self.kind}: {len(self._texts)} texts the dense model sampled from its start token "
            f"(temperature 1, at most {SAMPLE_TOKENS} tokens)"
        )

    def _text(self, row: dict) -> str:
        return row["text"]

    @torch.inference_mode()
    def _make(self, start: int) -> list[dict]:
        tok = self.tokenizer
        first = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        device = self.model.device
        gpus = [device.index or 0] if device.type == "cuda" else []
        ids = torch.full((BATCH, 1), first, device=device)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        with torch.random.fork_rng(devices=gpus):  # the caller's random state is left as it was
            torch.manual_seed(SEED + start)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=SAMPLE_TOKENS,
                pad_token_id=pad,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
            )
        new = out[:, 1:].cpu()
        texts = [tok.decode(row, skip_special_tokens=True).strip() for row in new]
        return [{"text": text} for text in texts if text]


def fingerprint(model, tokenizer) -> str:
    """What decides the answers: every weight's name, shape and dtype with its first and last values (reading them
    all would take minutes for a 70B model), the answers' length, and the chat template."""
    digest = hashlib.sha256(f"{ANSWER_TOKENS} {tokenizer.chat_template}".encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = torch.cat([flat[:64], flat[-64:]]).float().cpu().numpy()
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode() + sample.tobytes())
    return digest.hexdigest()[:24]


def mixed_documents() -> list[str]:
    """`builtin:mixed`'s documents (docstrings, code, READMEs) cut at `TEXT_CHARS`, to go in turn with conversations:
    text of several domains keeps what the model does on prose as the conversations keep its answers."""
    from .corpus import builtin_corpus

    return [document[:TEXT_CHARS] for document in builtin_corpus("mixed")[0]]


def in_turn(first: list[str], second: list[str]) -> list[str]:
    """One of each in turn, as long as both last."""
    return [text for pair in zip(first, second) for text in pair]

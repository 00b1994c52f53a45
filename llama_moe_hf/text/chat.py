"""`builtin:chat`: calibration and healing text in an instruct model's own chat format, made by the dense model.

Each document is one conversation: a prompt of `text.prompts`' calibration split (never a held-out one) as a
user turn, and the dense model's own greedy answer as the assistant's, rendered with the tokenizer's chat template.
Healing towards the dense model on them is sequence-level self-distillation (as MiniLLM, GKD and DistiLLM train on
the teacher's outputs): the converted model learns what its source does where its users meet it, not only on prose.
A model without a chat template has no chat format: `builtin:mixed` stands in (logged).

    chats = SelfDistilledChats(model, tokenizer)
    chats.texts(num_tokens)      the first conversations, at least `num_tokens` tokens of them, made once
    with_text(conversations)     `builtin:chat-mixed`: each followed by a document of `builtin:mixed`
"""

import logging

import torch

logger = logging.getLogger(__name__)

TEXT_CHARS = 600  # a mixed-corpus document cut to about a conversation's length, in turn with them
ANSWER_TOKENS = 96  # the answers' limit: longer than the check's 32, so that whole answers are healed on
BATCH = 32  # rows answered together: decoding a 135M model on a CPU is bound by per-step overhead
NAME = "chat"


class SelfDistilledChats:
    """The conversations, generated batch after batch as more tokens are asked for (a fixed order: the first ones
    are the same whatever is asked later)."""

    def __init__(self, model, tokenizer, progress: bool = True):
        from .prompts import prompts

        self.model, self.tokenizer, self.progress = model, tokenizer, progress
        self._prompts = prompts("calibration")
        self._texts: list[str] = []
        self.pairs: list[tuple[str, str]] = []  # (prompt, answer) of each conversation
        self._tokens = 0

    def description(self, mixed: bool = False) -> str:
        """What `conversion_info["calibration_data"]` records; it begins `built-in corpus NAME` as every built-in
        corpus's does (`recipe.preset_measurements` reads it)."""
        text = (
            f"built-in corpus {NAME}{'-mixed' if mixed else ''}: {len(self._texts)} calibration prompts with the "
            f"dense model's greedy answers (at most {ANSWER_TOKENS} tokens), in its chat template"
        )
        return text + (", each followed by a document of builtin:mixed" if mixed else "")

    def texts(self, num_tokens: int) -> list[str]:
        from tqdm.auto import tqdm

        bar = tqdm(desc="Answering calibration prompts", unit="token", total=num_tokens, disable=not self.progress)
        bar.update(min(self._tokens, num_tokens))
        while self._tokens < num_tokens and len(self._texts) < len(self._prompts):
            before = self._tokens
            self._answer(self._prompts[len(self._texts) : len(self._texts) + BATCH])
            bar.update(min(self._tokens, num_tokens) - min(before, num_tokens))
        bar.close()
        if self._tokens < num_tokens:
            logger.warning("The chat prompts ran out at %d tokens (%d asked for).", self._tokens, num_tokens)
        return list(self._texts)

    @torch.inference_mode()
    def _answer(self, batch) -> None:
        from ..behaviour import chat_ids, padded

        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ids, mask = padded([chat_ids(tok, p.text) for p in batch], pad, left=True)  # every row continues at its end
        out = self.model.generate(
            input_ids=ids.to(self.model.device),
            attention_mask=mask.to(self.model.device),
            max_new_tokens=ANSWER_TOKENS,
            do_sample=False,
            pad_token_id=pad,
        )
        for prompt, answer in zip(batch, out[:, ids.shape[1] :]):
            reply = tok.decode(answer, skip_special_tokens=True).strip()
            turns = [{"role": "user", "content": prompt.text}, {"role": "assistant", "content": reply}]
            text = tok.apply_chat_template(turns, tokenize=False)
            self._texts.append(text)
            self.pairs.append((prompt.text, reply))
            self._tokens += len(tok(text, add_special_tokens=False)["input_ids"])


def with_text(conversations: list[str]) -> list[str]:
    """The conversations and `builtin:mixed`'s documents (docstrings, code, READMEs), one of each in turn, the
    documents cut at `TEXT_CHARS`: text of several domains keeps what the model does on prose as the conversations
    keep its answers."""
    from .corpus import builtin_corpus

    documents = builtin_corpus("mixed")[0]
    return [text for pair in zip(conversations, documents) for text in (pair[0], pair[1][:TEXT_CHARS])]

"""Documents -> token ids -> fixed blocks: the one packing path of calibration, training, evaluation, analysis and
similarity batching. Every document is followed by EOS (when the tokenizer has one); blocks are cut from that one
stream, in order.

    document_tokens(documents, tokenizer)                 each document's ids + EOS, tokenized in batches as read
    token_stream(documents, tokenizer, max_tokens)        the first `max_tokens` tokens (all: None), `[N]`
    token_blocks(documents, tokenizer, seq_len, max_tokens)   `[seq_len]` blocks as they are read (streaming)
    pack_blocks(documents, tokenizer, seq_len, max_tokens)    `[B, seq_len]` (the remainder is dropped)
    pack(token_ids, order, seq_len)                       documents in a given order, cut every `seq_len`, each
                                                          token's document kept (`PackedSequences`: batch-similar)
"""

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

TOKENIZE_BATCH = 1024  # documents per tokenizer call at most: fast tokenizers work on a batch in parallel


def document_tokens(documents: Iterable[str], tokenizer, progress: bool = False) -> Iterator[list[int]]:
    """Each document's token ids followed by EOS (when the tokenizer has one), in order. Batches grow from one
    document to `TOKENIZE_BATCH`, so a reader that needs a few tokens of a large source tokenizes little ahead."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    documents, size = iter(documents), 1
    with tqdm(desc="Tokenizing", unit="doc", disable=not progress) as bar:
        while batch := list(itertools.islice(documents, size)):
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                yield ids + separator
            bar.update(len(batch))
            size = min(2 * size, TOKENIZE_BATCH)


def token_stream(documents: Iterable[str], tokenizer, max_tokens: int | None = None) -> torch.LongTensor:
    """The first `max_tokens` tokens of the documents (all of them: None), `[N]`."""
    stream: list[int] = []
    for ids in document_tokens(documents, tokenizer):
        stream.extend(ids)
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    return torch.tensor(stream[:max_tokens], dtype=torch.long)


def cut_blocks(stream: torch.LongTensor, seq_len: int) -> torch.LongTensor:
    """`[N]` -> `[N // seq_len, seq_len]`, the remainder dropped."""
    count = len(stream) // seq_len
    return stream[: count * seq_len].view(count, seq_len)


def pack_blocks(documents: Iterable[str], tokenizer, seq_len: int, max_tokens: int | None = None) -> torch.LongTensor:
    """`[B, seq_len]` blocks of the documents' stream (at most `max_tokens` tokens); the remainder is dropped."""
    return cut_blocks(token_stream(documents, tokenizer, max_tokens), seq_len)


def token_blocks(documents: Iterable[str], tokenizer, seq_len: int, max_tokens: int) -> Iterator[torch.LongTensor]:
    """`pack_blocks`'s blocks one at a time as the documents are read: only the current block's tokens are held."""
    buffer: list[int] = []
    remaining = max_tokens // seq_len
    for ids in document_tokens(documents, tokenizer):
        buffer.extend(ids)
        while len(buffer) >= seq_len and remaining:
            yield torch.tensor(buffer[:seq_len], dtype=torch.long)
            buffer, remaining = buffer[seq_len:], remaining - 1
        if not remaining:
            return


@dataclass
class PackedSequences:
    """One token stream cut into sequences of `seq_len` (the last may be shorter).

    tokens [N]: the documents' tokens in chain order, EOS after each; owner [N]: the document of every token.
    """

    tokens: np.ndarray
    owner: np.ndarray
    seq_len: int

    def __len__(self) -> int:
        return -(-len(self.tokens) // self.seq_len)

    def document_offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """(document ids, offsets [len + 1]): sequence i holds tokens of `ids[offsets[i]:offsets[i + 1]]`."""
        starts = np.ones(len(self.owner), dtype=bool)
        starts[1:] = self.owner[1:] != self.owner[:-1]
        starts[:: self.seq_len] = True  # a document cut at a border shows in both sequences
        positions = np.flatnonzero(starts)
        offsets = np.searchsorted(positions, np.arange(len(self) + 1) * self.seq_len)
        return self.owner[positions], offsets

    def rows(self):
        """Each sequence as {"input_ids": [...], "document_ids": [...]}."""
        ids, offsets = self.document_offsets()
        for i in range(len(self)):
            tokens = self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
            yield {"input_ids": tokens.tolist(), "document_ids": ids[offsets[i] : offsets[i + 1]].tolist()}

    def to_arrow(self):
        """A pyarrow table with the `rows` columns, built from the arrays without Python lists."""
        import pyarrow as pa

        token_offsets = np.minimum(np.arange(len(self) + 1) * self.seq_len, len(self.tokens)).astype(np.int32)
        ids, offsets = self.document_offsets()
        return pa.table(
            {
                "input_ids": pa.ListArray.from_arrays(token_offsets, self.tokens.astype(np.int32)),
                "document_ids": pa.ListArray.from_arrays(offsets.astype(np.int32), ids),
            }
        )


def pack(token_ids: list[list[int]], order: np.ndarray, seq_len: int) -> PackedSequences:
    """The documents' tokens (`document_tokens`: EOS included) in `order`, cut every `seq_len`."""
    lengths = np.fromiter((len(token_ids[doc]) for doc in order.tolist()), np.int64, len(order))
    stream = itertools.chain.from_iterable(token_ids[doc] for doc in order.tolist())
    tokens = np.fromiter(stream, dtype=np.int64, count=int(lengths.sum()))
    return PackedSequences(tokens=tokens, owner=np.repeat(order, lengths), seq_len=seq_len)

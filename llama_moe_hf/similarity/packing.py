"""Tokenize documents in chain order and pack them into fixed-length sequences, EOS after each document."""

import itertools
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

TOKENIZE_BATCH = 10_000


def tokenize(texts: list[str], tokenizer, progress: bool = False) -> list[list[int]]:
    ids = []
    for start in tqdm(range(0, len(texts), TOKENIZE_BATCH), desc="Tokenizing", disable=not progress):
        ids.extend(tokenizer(texts[start : start + TOKENIZE_BATCH], add_special_tokens=False)["input_ids"])
    return ids


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


def pack(token_ids: list[list[int]], order: np.ndarray, seq_len: int, eos_id: int | None) -> PackedSequences:
    """The documents' tokens in `order`, each followed by EOS (when the tokenizer has one), cut every `seq_len`."""
    separator = [] if eos_id is None else [eos_id]
    lengths = np.fromiter((len(token_ids[doc]) + len(separator) for doc in order.tolist()), np.int64, len(order))
    stream = itertools.chain.from_iterable(token_ids[doc] + separator for doc in order.tolist())
    tokens = np.fromiter(stream, dtype=np.int64, count=int(lengths.sum()))
    return PackedSequences(tokens=tokens, owner=np.repeat(order, lengths), seq_len=seq_len)

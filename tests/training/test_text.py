"""The one documents -> tokens -> blocks path (`llama_moe.text.tokens`): every reader cuts the same EOS-joined
stream, whichever way it packs it."""

import numpy as np
import torch
from helpers import char_tokenizer

from llama_moe.text.tokens import (
    TOKENIZE_BATCH,
    cut_blocks,
    document_tokens,
    pack,
    pack_blocks,
    token_blocks,
    token_stream,
)

DOCS = [f"document {i}: " + "word " * (i % 7) for i in range(TOKENIZE_BATCH + 300)]  # more than one full batch


def test_every_packing_cuts_the_same_eos_joined_stream():
    tokenizer = char_tokenizer()
    one_by_one = [tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for doc in DOCS]
    assert list(document_tokens(DOCS, tokenizer)) == one_by_one  # batched tokenization changes nothing
    stream = token_stream(DOCS, tokenizer)
    assert stream.tolist() == [token for ids in one_by_one for token in ids]
    blocks = pack_blocks(DOCS, tokenizer, 16)
    assert torch.equal(blocks, cut_blocks(stream, 16)) and blocks.shape == (len(stream) // 16, 16)
    assert torch.equal(torch.stack(list(token_blocks(DOCS, tokenizer, 16, len(stream)))), blocks)
    assert torch.equal(pack_blocks(DOCS, tokenizer, 16, max_tokens=40), stream[:32].view(2, 16))
    order = np.arange(len(DOCS))[::-1].copy()
    packed = pack(one_by_one, order, 16)
    assert packed.tokens.tolist() == [token for doc in order for token in one_by_one[doc]]
    assert packed.owner[0] == order[0] and len(packed) == -(-len(stream) // 16)


def test_a_small_budget_tokenizes_little_ahead():
    tokenizer = char_tokenizer()
    seen = []

    def documents():
        for doc in DOCS:
            seen.append(doc)
            yield doc

    assert len(token_stream(documents(), tokenizer, max_tokens=10)) == 10
    assert len(seen) == 1  # the first batch is one document

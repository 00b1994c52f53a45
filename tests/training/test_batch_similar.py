"""Similarity-based document batching: `llama-moe batch-similar` and its parts."""

import json

import numpy as np
import pytest
from datasets import load_from_disk

from llama_moe.commands import main
from llama_moe.similarity.chaining import chain_documents
from llama_moe.similarity.embedders import EMBEDDERS
from llama_moe.similarity.neighbours import nearest_neighbours
from llama_moe.similarity.options import BatchSimilarOptions
from llama_moe.similarity.pipeline import batch_similar

TOPICS = {
    "sql": "database table query index transaction rows columns join select schema",
    "web": "http request response server header cookie url browser status client",
    "math": "matrix vector eigenvalue integral derivative equation theorem proof prime",
}


def topic_documents(per_topic: int = 40, seed: int = 0) -> tuple[list[str], list[str]]:
    """Short documents on three topics, shuffled: (texts, their topics)."""
    rng = np.random.default_rng(seed)
    docs = [
        (" ".join(rng.choice(words.split(), size=12)), topic)
        for topic, words in TOPICS.items()
        for _ in range(per_topic)
    ]
    order = rng.permutation(len(docs))
    return [docs[i][0] for i in order], [docs[i][1] for i in order]


def test_chain_is_a_permutation_and_follows_neighbours():
    rng = np.random.default_rng(0)
    neighbours = rng.integers(-1, 500, size=(500, 6))
    order = chain_documents(neighbours, seed=3)
    assert sorted(order.tolist()) == list(range(500))
    assert np.array_equal(order, chain_documents(neighbours, seed=3))
    for current, following in zip(order[:-1], order[1:]):  # a neighbour whenever an unvisited one was left
        visited = set(order[: np.flatnonzero(order == following)[0]].tolist())
        unvisited = [n for n in neighbours[current] if n >= 0 and n not in visited]
        assert following == (unvisited[0] if unvisited else following)


def test_faiss_and_scikit_learn_find_the_same_neighbours():
    embeddings = np.random.default_rng(0).standard_normal((300, 32)).astype(np.float32)
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    exact = nearest_neighbours(embeddings, 5, search="sklearn")
    assert np.array_equal(nearest_neighbours(embeddings, 5, search="faiss"), exact)
    assert not (exact == np.arange(300)[:, None]).any()


def test_approximate_faiss_search_finds_nearly_all_true_neighbours_of_clustered_embeddings():
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((100, 32))
    embeddings = (centres[rng.integers(0, 100, 3000)] + 0.3 * rng.standard_normal((3000, 32))).astype(np.float32)
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    exact = nearest_neighbours(embeddings, 5, search="sklearn")
    approximate = nearest_neighbours(embeddings, 5, search="faiss", exact_limit=100)  # an IVF index above 100
    recall = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(approximate, exact)])
    assert recall > 0.95


def test_similar_documents_end_up_next_to_each_other():
    texts, topics = topic_documents()
    options = BatchSimilarOptions(output="unused", neighbours=5, progress=False)
    order = chain_documents(nearest_neighbours(EMBEDDERS["tfidf"](options).embed(texts), 5), seed=0)
    same_topic = np.mean([topics[a] == topics[b] for a, b in zip(order[:-1], order[1:])])
    shuffled = np.mean([topics[a] == topics[b] for a, b in zip(range(len(texts) - 1), range(1, len(texts)))])
    assert same_topic > 0.8 and shuffled < 0.5  # restarts at random documents cross topics


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_document_appears_exactly_once_in_the_packed_sequences(tmp_path, smollm2, real_text):
    _, tokenizer = smollm2
    texts = real_text[:150]
    options = BatchSimilarOptions(output=str(tmp_path / "packed.jsonl"), seq_len=256, progress=False)
    result = batch_similar(options, texts=texts, tokenizer=tokenizer)
    rows = read_jsonl(tmp_path / "packed.jsonl")
    assert len(rows) == result.sequences and all(len(row["input_ids"]) == 256 for row in rows[:-1])
    order = []
    for row in rows:  # a document cut at a border is listed by both sequences
        order += row["document_ids"][1:] if order and row["document_ids"][0] == order[-1] else row["document_ids"]
    assert sorted(order) == list(range(len(texts)))
    expected = [t for doc in order for t in tokenizer(texts[doc], add_special_tokens=False).input_ids + [2]]
    assert tokenizer.eos_token_id == 2
    assert [t for row in rows for t in row["input_ids"]] == expected

    datasets_options = BatchSimilarOptions(output=str(tmp_path / "packed"), seq_len=256, progress=False)
    batch_similar(datasets_options, texts=texts, tokenizer=tokenizer)
    assert load_from_disk(str(tmp_path / "packed")).to_list() == rows


@pytest.mark.parametrize("embedder", ["transformers", "sentence-transformers"])
def test_embeddings_from_a_local_encoder(tiny_dense, embedder):
    options = BatchSimilarOptions(output="unused", embedder=embedder, encoder=str(tiny_dense[0]), progress=False)
    texts, _ = topic_documents(per_topic=4)
    embeddings = EMBEDDERS[embedder](options).embed(texts)
    assert embeddings.shape == (12, 64) and np.allclose(np.linalg.norm(embeddings, axis=1), 1, atol=1e-5)


def test_command_line_writes_a_datasets_folder(tmp_path, smollm2_path):
    texts, _ = topic_documents()
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    argv = ["batch-similar", "--documents", str(tmp_path / "docs.jsonl"), "--output", str(out), "--no-progress"]
    assert main([*argv, "--tokenizer", str(smollm2_path), "--seq-len", "64"]) == 0
    assert load_from_disk(str(out)).num_rows > 0
    assert main([*argv, "--tokenizer", str(smollm2_path)]) == 2  # exists: --overwrite needed


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--neighbours", "0"], "--neighbours must be at least 1"),
        (["--embedder", "transformers"], "needs --encoder MODEL"),
        (["--documents", "missing-folder/docs.jsonl"], "Documents file missing-folder/docs.jsonl does not exist"),
    ],
)
def test_bad_input_gets_one_line_and_leaves_nothing(tmp_path, capsys, flags, message):
    out = tmp_path / "out.jsonl"
    assert main(["batch-similar", "--output", str(out), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert list(tmp_path.iterdir()) == []

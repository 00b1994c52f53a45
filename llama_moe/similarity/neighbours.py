"""Nearest neighbours of every document among all the others, by cosine similarity of normalised embeddings.

faiss (faiss-cpu) searches exactly up to `exact_search_limit` documents and with an IVF index above (approximate,
the only way to stay near-linear at millions of documents); scikit-learn's brute force is the fallback when faiss is
not installed (exact, quadratic time).
"""

import math

import numpy as np

from ..preflight import installed, require


def nearest_neighbours(embeddings: np.ndarray, k: int, search: str = "auto", exact_limit: int = 100_000) -> np.ndarray:
    """[n, d] normalised embeddings -> [n, min(k, n - 1)] ids of each document's nearest others, nearest first."""
    n = embeddings.shape[0]
    k = min(k, n - 1)
    if k < 1:
        return np.zeros((n, 0), dtype=np.int64)
    if search == "auto":
        search = "faiss" if installed("faiss") else "sklearn"
    if search == "faiss":
        require("faiss", "--search faiss")
        found = _faiss_search(np.ascontiguousarray(embeddings, dtype=np.float32), k + 1, exact_limit)
    elif search == "sklearn":
        from sklearn.neighbors import NearestNeighbors

        found = NearestNeighbors(n_neighbors=k + 1, metric="cosine", algorithm="brute").fit(embeddings)
        found = found.kneighbors(embeddings, return_distance=False)
    else:
        raise ValueError(f"Unknown search {search!r}; choose auto, faiss or sklearn.")
    return _without_self(found, k)


def _faiss_search(embeddings: np.ndarray, k: int, exact_limit: int) -> np.ndarray:
    import faiss

    n, dim = embeddings.shape
    if n <= exact_limit:
        index = faiss.IndexFlatIP(dim)
    else:
        lists = int(4 * math.sqrt(n))  # faiss' guideline: 4 sqrt(n) to 16 sqrt(n) inverted lists
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(0)
        index.train(embeddings[rng.choice(n, size=min(n, 64 * lists), replace=False)])
        index.nprobe = 16
    index.add(embeddings)
    return index.search(embeddings, k)[1]


def _without_self(found: np.ndarray, k: int) -> np.ndarray:
    """Drop each row's own id (usually first, not always: duplicates tie) and the -1 faiss gives for missing
    neighbours; keep k."""
    found = found.astype(np.int64)
    drop = (found == np.arange(len(found))[:, None]) | (found < 0)
    order = np.argsort(drop, axis=1, kind="stable")  # kept ids first, in their order
    kept = np.take_along_axis(found, order, axis=1)[:, :k]
    return np.where(np.take_along_axis(drop, order, axis=1)[:, :k], -1, kept)

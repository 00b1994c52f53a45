"""Greedy chaining of documents by similarity (in-context pre-training, Shi et al. 2023, simplified)."""

import numpy as np
from tqdm.auto import tqdm


def chain_documents(neighbours: np.ndarray, seed: int = 0, progress: bool = False) -> np.ndarray:
    """An order of all n documents (a permutation of 0..n-1): start at a random document, go on to its nearest
    unvisited neighbour, and when all its neighbours are visited start again at a random unvisited document.

    neighbours: [n, k] ids, nearest first (-1: none).
    """
    n = len(neighbours)
    visited = np.zeros(n, dtype=bool)
    starts = np.random.default_rng(seed).permutation(n)
    order = np.empty(n, dtype=np.int64)
    next_start, current = 0, -1
    for position in tqdm(range(n), desc="Chaining documents", unit="doc", disable=not progress, miniters=n // 100):
        following = -1
        if current >= 0:
            for candidate in neighbours[current].tolist():
                if candidate >= 0 and not visited[candidate]:
                    following = candidate
                    break
        if following < 0:
            while visited[starts[next_start]]:
                next_start += 1
            following = int(starts[next_start])
        visited[following] = True
        order[position] = current = following
    return order

"""Time and peak memory of `llama-moe batch-similar` for 10k, 100k and 1M short documents (docs/soap.md).

Each size runs in its own process (peak RSS is per process): the default pipeline (TF-IDF + SVD to 128 dimensions,
faiss search, exact up to 100k documents and IVF above, greedy chaining, SmolLM2 tokenizer, 2048-token sequences,
datasets folder output). Documents: 1-3 sentences drawn at random from the Python standard-library docstrings.

    python benchmarks/speed/bench_batch_similar.py                   # 10k, 100k, 1M
    python benchmarks/speed/bench_batch_similar.py --sizes 10000     # one size
    python benchmarks/speed/bench_batch_similar.py --sizes 10000 100000 --search sklearn   # without faiss
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time


def short_documents(count: int, seed: int = 0) -> list[str]:
    import re

    import numpy as np

    from llama_moe.text.corpus import stdlib_docstrings

    sentences = [s.strip() for text in stdlib_docstrings() for s in re.split(r"(?<=[.!?])\s+", text) if len(s) > 20]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(sentences), size=(count, 3))
    lengths = rng.integers(1, 4, size=count)
    return [" ".join(sentences[i] for i in row[:n]) for row, n in zip(picks.tolist(), lengths.tolist())]


def run_one(count: int, search: str) -> dict:
    from llama_moe.similarity.options import BatchSimilarOptions
    from llama_moe.similarity.pipeline import batch_similar

    texts = short_documents(count)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        result = batch_similar(BatchSimilarOptions(output=f"{tmp}/out", search=search, progress=False), texts=texts)
        total = time.perf_counter() - start
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    return {
        "documents": count,
        "search": search,
        "tokens": result.tokens,
        "seconds": round(total, 1),
        "stages": {k: round(v, 1) for k, v in result.seconds.items()},
        "peak_rss_gb": round(peak_gb, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--search", default="auto", choices=["auto", "faiss", "sklearn"])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.search)))
        return
    for count in args.sizes:
        child = subprocess.run(
            [sys.executable, __file__, "--one", str(count), "--search", args.search], capture_output=True, text=True
        )
        if child.returncode:
            print(f"{count}: failed\n{child.stderr[-2000:]}")
            continue
        print(child.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()

"""Time of balanced k-means (`k-means-constrained`, one start) at LLaMA-7B FFN size: 11008 unit rows of 4096 dims.

python benchmarks/speed/balanced_kmeans_scale.py --max-iter 10
"""

import argparse
import time

import numpy as np
from k_means_constrained import KMeansConstrained


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=11008)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--max-iter", type=int, default=10)
    args = parser.parse_args()
    x = np.random.default_rng(0).standard_normal((args.rows, args.dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    size = args.rows // args.clusters
    start = time.perf_counter()
    KMeansConstrained(
        n_clusters=args.clusters, size_min=size, size_max=size, random_state=0, n_init=1, max_iter=args.max_iter
    ).fit(x)
    print(
        f"{args.rows} x {args.dim}, {args.clusters} clusters, {args.max_iter} iterations: "
        f"{time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()

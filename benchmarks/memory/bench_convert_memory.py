"""Peak memory and wall time of a streaming conversion, next to the time it takes just to read the source files.

    # the built-in SmolLM2-135M-Instruct (538 MB in float32)
    python benchmarks/memory/bench_convert_memory.py --max-shard-size 200MB
    # a synthetic 7B-shaped bfloat16 checkpoint (13.5 GB), written shard by shard
    python benchmarks/memory/make_synthetic_checkpoint.py /tmp/synth7b --shape 7b --dtype bfloat16
    python benchmarks/memory/bench_convert_memory.py --model /tmp/synth7b --max-shard-size 1GB

Before each timed step the source files are evicted from the page cache (`posix_fadvise(DONTNEED)`), so reading
and converting both start from disk. Reports the process's peak resident set (`ru_maxrss`, which includes pages
of memory-mapped source files while they are mapped) and the peak anonymous memory (`RssAnon`, sampled every
20 ms: the converter's own working memory), both above what the imports use.
"""

import argparse
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

import llama_moe_hf
from llama_moe.checkpoints import default_model_path


def rss_anon_mb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("RssAnon"))


def evict_from_page_cache(files: list[Path]) -> None:
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_seconds(files: list[Path], chunk: int = 64 << 20) -> float:
    """Time to read every byte of `files` once (the floor for any converter)."""
    start = time.perf_counter()
    buffer = bytearray(chunk)
    for file in files:
        with open(file, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="source folder or .gguf (default: built-in SmolLM2)")
    parser.add_argument("--output-dir", type=Path, default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--method", default="random")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()

    source = args.model or default_model_path()  # prepared before measuring
    files = [source] if source.suffix == ".gguf" else sorted(source.glob("*.safetensors"))
    source_gb = sum(f.stat().st_size for f in files) / 1e9
    evict_from_page_cache(files)
    read_time = read_seconds(files)
    evict_from_page_cache(files)

    base_anon = rss_anon_mb()
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    peak = [base_anon]

    def sample():
        while True:
            peak[0] = max(peak[0], rss_anon_mb())
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    with tempfile.TemporaryDirectory(dir=args.output_dir) as tmp:
        start = time.perf_counter()
        result = llama_moe_hf.convert_to_moe(
            source, Path(tmp) / "moe", method=args.method, num_experts=args.num_experts, top_k=args.top_k,
            max_shard_size=args.max_shard_size, progress=False,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        time.sleep(0.1)
        output_gb = sum(p.stat().st_size for p in result.output_dir.iterdir()) / 1e9
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"source {source} ({source_gb:.2f} GB, {len(files)} files): read in {read_time:.1f} s")
    print(
        f"convert --method {args.method} --num-experts {args.num_experts} --top-k {args.top_k} "
        f"--max-shard-size {args.max_shard_size}: {seconds:.1f} s ({seconds / read_time:.2f}x the read time), "
        f"output {output_gb:.2f} GB"
    )
    print(
        f"peak RSS {maxrss} MB ({maxrss - base_maxrss:+d} MB over the imports' {base_maxrss} MB); "
        f"peak anonymous memory {peak[0]} MB ({peak[0] - base_anon:+d} MB over the imports)"
    )


if __name__ == "__main__":
    main()

"""Wall time, CPU time and peak memory of one `llama-moe convert`, and the result's held-out perplexity next to the
dense model's (`llama-moe eval`, the same text and windows for both).

    # the measured-best preset, scored on the Python tutorial and the offline-data math test split
    python benchmarks/quality/bench_convert_recipe.py \
        --data tutorial=/tmp/heldout/tutorial math=/tmp/heldout/math-test.jsonl -- --preset g-moefication
    # the same recipe run by another source tree (e.g. an unpacked `git archive` of an older commit)
    python benchmarks/quality/bench_convert_recipe.py --tree /tmp/base --data ... -- --config recipes/convert/g-moefication.yaml

Everything after `--` goes to `llama-moe convert` as given (`--output` and `--no-progress` are added). The convert
and eval commands each run in their own process with `--threads` torch threads; peak RSS and CPU time are those of
the convert process alone (`wait4`), and the 1-minute load average before and after is printed, because other jobs
on the machine lengthen the wall time. Use text the calibration never saw: the built-in calibration corpus is the
standard library's docstrings.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cli(tree: Path, args: list[str], threads: int) -> tuple[list[str], dict]:
    """The `llama-moe` command line run from `tree`, and its environment."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return [sys.executable, "-m", "llama_moe", *args], env


def timed(command: list[str], env: dict, cwd: Path) -> dict:
    """Run `command`; its wall time, CPU time (user + system) and peak RSS."""
    print("$", shlex.join(command[2:]).replace("llama_moe", "llama-moe", 1), flush=True)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=cwd)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"command failed with status {os.waitstatus_to_exitcode(status)}")
    return {
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_gb": round(usage.ru_maxrss / 1e6, 2),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def eval_perplexities(model: str, data: list[str], args, output: Path) -> dict[str, float]:
    """`llama-moe eval MODEL --data ...` (results written to `output`) -> {source name: perplexity}: any texts, in
    the process the command runs in (`benchmarks.common.perplexities` scores the held-out texts in this one)."""
    flags = [
        "--data",
        *data,
        "--window",
        str(args.window),
        "--stride",
        str(args.window),
        "--max-tokens",
        str(args.max_tokens),
    ]
    command, env = cli(REPO, ["eval", model, *flags, "--output", str(output)], args.threads)
    timed(command, env, REPO)
    results = json.loads(output.read_text())["perplexity"]
    return {name: result["perplexity"] for name, result in results.items()}


def dense_perplexities(args, workdir: Path) -> dict[str, float]:
    """The dense model's perplexities, from `--dense-results` when it holds these sources (same windows assumed)."""
    path = args.dense_results
    names = [spec.split("=", 1)[0] for spec in args.data]
    if path is not None and path.exists():
        cached = json.loads(path.read_text())["perplexity"]
        if set(names) <= set(cached):
            print(f"dense perplexities from {path}")
            return {name: cached[name]["perplexity"] for name in names}
    return eval_perplexities("default", args.data, args, path or workdir / "dense-eval.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", action="extend", required=True, help="NAME=PATH of held-out text")
    parser.add_argument("--tree", type=Path, default=REPO, help="source tree whose llama-moe converts (default: this)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=256, help="eval window and stride (non-overlapping)")
    parser.add_argument("--max-tokens", type=int, default=32768, help="held-out tokens per source")
    parser.add_argument("--keep", type=Path, default=None, help="keep the converted model in this folder")
    parser.add_argument(
        "--dense-results", type=Path, default=None, help="the dense model's eval results: read if there, else written"
    )
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, convert_args = parser.parse_args(argv[:split]), argv[split + 1 :]  # after `--`: llama-moe convert's flags

    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        workdir = Path(tmp)
        output = args.keep or workdir / "moe"
        command, env = cli(
            args.tree, ["convert", *convert_args, "--output", str(output), "--no-progress"], args.threads
        )
        convert = timed(command, env, args.tree)
        moe = eval_perplexities(str(output), args.data, args, workdir / "moe-eval.json")
        dense = dense_perplexities(args, workdir)
    print(f"\nconvert ({args.threads} threads, tree {args.tree}): {shlex.join(convert_args)}")
    print(
        f"  wall {convert['wall_s']} s, CPU {convert['cpu_s']} s, peak RSS {convert['peak_rss_gb']} GB, "
        f"load average {convert['load_before']:.2f} before / {convert['load_after']:.2f} after"
    )
    for name in moe:
        print(f"  {name}: perplexity {moe[name]:.3f}, dense {dense[name]:.3f}, ratio {moe[name] / dense[name]:.3f}")


if __name__ == "__main__":
    main()

"""How fast the `llama-moe` command answers when it needs no model: `--help`, `convert --help`, an argument error.

Each command runs `--runs` times in a fresh process (the installed `llama-moe` console script, so what users run);
the table gives the median and the range of the wall time, next to a bare `python -c pass` for the interpreter's own
start and the time `import torch` alone takes, which the command line avoids.

    python benchmarks/bench_cli_start.py
    python benchmarks/bench_cli_start.py --runs 20
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "llama-moe --help": ["llama-moe", "--help"],
    "llama-moe convert --help": ["llama-moe", "convert", "--help"],
    "llama-moe convert --top-k x (error)": ["llama-moe", "convert", "--top-k", "x"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    if shutil.which("llama-moe") is None:
        raise SystemExit("The llama-moe command is not installed: pip install -e .")
    print(f"{args.runs} runs each, wall time in seconds")
    print("| command | median | min | max |")
    print("|---|---|---|---|")
    for name, command in COMMANDS.items():
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            subprocess.run(command, capture_output=True, check=False)
            times.append(time.perf_counter() - start)
        print(f"| `{name}` | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} |", flush=True)


if __name__ == "__main__":
    main()

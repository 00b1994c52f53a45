"""How fast the `llama-moe` command answers when it needs no model: `--help`, `convert --help`, an argument error.

Each command runs `--runs` times in a fresh process (the installed `llama-moe` console script, so what users run);
the table gives the median and the range of the wall time, next to a bare `python -c pass` for the interpreter's own
start and the time `import torch` alone takes, which the command line avoids.

    python benchmarks/speed/bench_cli_start.py
    python benchmarks/speed/bench_cli_start.py --runs 20
"""

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import interleaved_times, record

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
    parser.add_argument("--record", action="store_true", help="append the rows to benchmarks/results/cli_start.jsonl")
    args = parser.parse_args()
    if shutil.which("llama-moe") is None:
        raise SystemExit("The llama-moe command is not installed: pip install -e .")
    print(f"{args.runs} runs each, wall time in seconds")
    print("| command | median | min | max |")
    print("|---|---|---|---|")
    for name, command in COMMANDS.items():
        run = {name: lambda command=command: subprocess.run(command, capture_output=True, check=False)}
        times = interleaved_times(run, args.runs)[name]
        print(f"| `{name}` | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} |", flush=True)
        if args.record:
            seconds = {"median": statistics.median(times), "min": min(times), "max": max(times)}
            record("cli_start", {"table": "cli_start", "timed_command": name, **seconds})


if __name__ == "__main__":
    main()

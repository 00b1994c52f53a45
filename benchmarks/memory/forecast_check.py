"""The memory forecast `llama-moe convert` prints against the peak it then reaches.

Runs `llama-moe convert ARGS` in a child process, reads the forecast the output recorded (`conversion_info`'s
`memory_forecast_gib`: each stage's peak) and puts its largest stage beside the child's peak resident memory (getrusage's
`ru_maxrss` of the child); `--record` appends the row to `benchmarks/results/forecast.jsonl`. `--force` is added to
the command, so a forecast over the free memory is measured too.

    python benchmarks/memory/forecast_check.py -- --preset sparse-50 --heal-tokens 1024 --output /tmp/s50
    python benchmarks/memory/forecast_check.py --label synthetic-1b -- --model /tmp/synth1b --method residual ...
"""

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import record

GIB = 1024**3


def stages(output: str) -> dict[str, float]:
    """`{stage: GiB}` the conversion written to `output` forecast."""
    config = json.loads((Path(output) / "config.json").read_text())
    return config["conversion_info"]["memory_forecast_gib"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default=None, help="the row's name (default: the convert arguments)")
    parser.add_argument("--record", action="store_true", help="append the row to benchmarks/results/forecast.jsonl")
    parser.add_argument("convert_args", nargs=argparse.REMAINDER, help="after --: the arguments of llama-moe convert")
    args = parser.parse_args()
    convert_args = [a for a in args.convert_args if a != "--"]
    if shutil.which("llama-moe") is None:
        raise SystemExit("The llama-moe command is not installed: pip install -e .")
    start = time.perf_counter()
    done = subprocess.run(["llama-moe", "convert", *convert_args, "--force"], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"llama-moe convert failed (exit {done.returncode}).")
    forecast = stages(convert_args[convert_args.index("--output") + 1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB  # kB on Linux
    largest = max(forecast.values())
    label = args.label or " ".join(convert_args)
    print(f"{label}: forecast {forecast} (largest {largest:.1f} GiB), measured peak RSS {peak:.2f} GiB, ")
    print(f"forecast / measured {largest / peak:.2f}, {seconds / 60:.1f} min")
    if args.record:
        numbers = {"label": label, "forecast": forecast, "forecast_gib": largest, "peak_gib": round(peak, 2)}
        record("forecast", numbers | {"ratio": round(largest / peak, 3), "minutes": round(seconds / 60, 1)})


if __name__ == "__main__":
    main()

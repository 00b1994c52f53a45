"""The forecast `llama-moe convert` prints before it starts, against what the run then takes.

Runs `llama-moe convert ARGS` in a child process and puts the forecast the output recorded (`conversion_info`'s
`forecast`) beside what was measured:

- memory: the largest stage's peak against the child's peak resident memory (getrusage's `ru_maxrss`);
- time: each stage's expected seconds against its own wall time (both from the run's "Stage times" log line);
- disk: the largest stage's files against the most the run held at once under the output's parent folder and the
  temporary folder (polled every 0.2 s; what was there before the run is not counted).

`--record` appends the row to `benchmarks/results/forecast.jsonl`. `--force` is added to the command, so a forecast
over the free memory is measured too. Run nothing else meanwhile: the times are the point.

    python benchmarks/memory/forecast_check.py -- --preset sparse-50 --heal-tokens 1024 --output /tmp/fc/s50
    python benchmarks/memory/forecast_check.py --label synthetic-1b -- --model /tmp/synth1b --method residual ...
"""

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import record

GIB = 1024**3


def _size(path: Path) -> int:
    if path.is_file() and not path.is_symlink():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:  # removed meanwhile
                pass
    return total


class DiskWatch:
    """The most bytes the new entries of `folders` held at once while the run went on."""

    def __init__(self, folders: list[Path]):
        self.folders = [folder for folder in dict.fromkeys(folders) if folder.is_dir()]
        self.before = {folder: set(folder.iterdir()) for folder in self.folders}
        self.peak, self.done = 0, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while not self.done.wait(0.2):
            held = sum(_size(p) for f in self.folders for p in set(f.iterdir()) - self.before[f])
            self.peak = max(self.peak, held)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def stage_times(log: str) -> tuple[dict, float]:
    """`({stage: {"forecast", "measured"}}, matmul GFLOP/s)` from the run's "Stage times" line."""
    line = next(line for line in log.splitlines() if line.startswith("Stage times"))
    times = {
        name: {"forecast": float(expected), "measured": float(took)}
        for name, took, expected in re.findall(r"([a-z ]+?) ([\d.]+) \(([\d.]+)\)", line.split(": ", 1)[1])
    }
    return {name.strip(", "): t for name, t in times.items()}, float(re.search(r"matmul ([\d.]+)", line).group(1))


def compare(info: dict, log: str, peak_rss: float, peak_disk: float) -> dict:
    forecast = info["forecast"]
    times, rate = stage_times(log)
    largest = max(forecast["memory_gib"].values())
    disk = max(forecast["disk_gib"].values(), default=0.0)
    return {
        "memory": {"forecast_gib": largest, "peak_gib": round(peak_rss, 2), "ratio": round(largest / peak_rss, 3)},
        "seconds": {s: t | {"ratio": round(t["forecast"] / max(t["measured"], 0.1), 3)} for s, t in times.items()},
        "disk": {"forecast_gib": disk, "peak_gib": round(peak_disk, 3)},
        "matmul_gflops": rate,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default=None, help="the row's name (default: the convert arguments)")
    parser.add_argument("--record", action="store_true", help="append the row to benchmarks/results/forecast.jsonl")
    parser.add_argument("convert_args", nargs=argparse.REMAINDER, help="after --: the arguments of llama-moe convert")
    args = parser.parse_args()
    convert_args = [a for a in args.convert_args if a != "--"]
    if shutil.which("llama-moe") is None:
        raise SystemExit("The llama-moe command is not installed: pip install -e .")
    if "--output" not in convert_args:
        raise SystemExit("Give the conversion an --output (in a folder of its own: its disk use is measured there).")
    output = Path(convert_args[convert_args.index("--output") + 1]).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    watch = DiskWatch([output.parent, Path(tempfile.gettempdir())])
    start = time.perf_counter()
    done = subprocess.run(["llama-moe", "convert", *convert_args, "--force"], capture_output=True, text=True)
    minutes, peak_disk = (time.perf_counter() - start) / 60, watch.stop() / GIB
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"llama-moe convert failed (exit {done.returncode}).")
    info = json.loads((output / "config.json").read_text())["conversion_info"]
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB  # kB on Linux
    row = compare(info, done.stderr, peak_rss, peak_disk)
    label = args.label or " ".join(convert_args)
    print(f"{label} ({minutes:.1f} min):")
    print(json.dumps(row, indent=1))
    if args.record:
        record("forecast", {"label": label, "minutes": round(minutes, 1)} | row)


if __name__ == "__main__":
    main()

"""The training recipes' memory estimate (llama_moe/footprint.py) against the peak they really reach.

    llama-moe convert --output outputs/smollm2-moe --method upcycle --num-experts 8 --top-k 2 --dtype bfloat16
    llama-moe offline-data --output data/offline
    python benchmarks/memory/training_memory.py                       # every case, one after the other (about 15 min)
    python benchmarks/memory/training_memory.py --cases cpt-readme sft-stage1

Each case runs a recipe as it ships, in a fresh process, for `--steps` optimizer steps (so the optimizer states exist
during a backward pass), with `--force true` so that cases beyond the free memory still run. The estimate is the one
the recipe's own preflight makes (its `check_memory`, run here on the same arguments up to that point); the peak is
the child's own `ru_maxrss` (os.wait4). Also reported: the
seconds per optimizer step from the Trainer's `train_runtime`. One line of JSON per case is appended to
benchmarks/results/training_memory.jsonl; the table is in docs/training.md ("Memory").
"""

import argparse
import os
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root: `benchmarks.common`

from benchmarks.common import RESULTS, record

RESULTS = RESULTS / "training_memory.jsonl"
MOE = "outputs/smollm2-moe"
CPT = ["recipes/continual_pretrain.py", "--config", "recipes/pretrain/llama-moe-v1.yaml", "--eval_blocks", "1"]
SFT = ["recipes/sft.py", "--config", "recipes/sft/stage1-general.yaml", "--eval_strategy", "no"]
ONE = ["--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1"]
CASES = {
    # the README's CPU command: 1 x 1024 tokens, activation checkpointing
    "cpt-readme": CPT + ["--model_name_or_path", MOE, "--activation_checkpointing", "true", *ONE],
    "cpt-no-checkpointing": CPT + ["--model_name_or_path", MOE, "--seq_len", "512", *ONE],
    "cpt-dense-batch4": CPT + ["--model_name_or_path", "default", "--gradient_accumulation_steps", "1"],
    "cpt-distill": CPT
    + ["--model_name_or_path", MOE, "--activation_checkpointing", "true", "--distill_alpha", "0.5", *ONE],
    "cpt-adafactor": CPT
    + ["--model_name_or_path", MOE, "--activation_checkpointing", "true", "--optim", "adafactor"]
    + ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1"],
    "sft-stage1": SFT + ["--model_name_or_path", MOE, *ONE],
    "soap-small": ["recipes/pretrain_soap.py", "--config", "recipes/pretrain/soap-small.yaml"],
}
RUNTIME = re.compile(r"'train_runtime': '?([0-9.]+)")


class Estimated(Exception):
    """Stops a recipe's preflight once its memory estimate is made."""


def estimate(argv: list[str]) -> float:
    """GiB: the estimate the recipe `argv[0]` makes in its preflight for the arguments `argv[1:]`."""
    from llama_moe.footprint import GIB
    from llama_moe.training import memory_check

    def stop(*args, **kwargs):
        raise Estimated(memory_check.estimate_run(*args, **kwargs)[0].total / GIB)

    check, memory_check.check_memory = memory_check.check_memory, stop
    try:
        runpy.run_path(str(ROOT / argv[0]))["main"](argv[1:])
    except Estimated as estimated:
        return round(estimated.args[0], 2)
    finally:
        memory_check.check_memory = check
    raise SystemExit(f"{argv[0]} made no memory estimate")


def run_case(name: str, steps: int, workdir: Path) -> dict:
    output = workdir / name
    argv = [*CASES[name], "--output_dir", str(output), "--use_cpu", "true", "--max_steps", str(steps)]
    argv += ["--overwrite_output_dir", "true", "--force", "true", "--report_to", "none", "--save_strategy", "no"]
    estimated = estimate(argv)
    command = [sys.executable, *argv]
    start = time.perf_counter()
    with open(workdir / f"{name}.log", "w") as log:
        child = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    text = (workdir / f"{name}.log").read_text(errors="replace")
    if status != 0:
        raise SystemExit(f"{name} failed (status {status}); see {workdir / name}.log")
    peak = usage.ru_maxrss * 1024 / 1024**3  # KiB -> GiB
    runtimes = [float(x) for x in RUNTIME.findall(text)]
    return {
        "case": name,
        "command": " ".join(["python", *CASES[name], "--use_cpu", "true", "--max_steps", str(steps)]),
        "estimate_gib": estimated,
        "peak_gib": round(peak, 2),
        "estimate_over_peak": round(estimated / peak, 3),
        "seconds_per_step": round(sum(runtimes) / steps, 1) if runtimes else None,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "threads": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per case (default: 2)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/llama-moe-training-memory"))
    parser.add_argument("--no-record", action="store_true", help=f"do not append to {RESULTS.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    print("| case | estimate (GiB) | peak RSS (GiB) | estimate / peak | s / step |\n|---|---:|---:|---:|---:|")
    for name in args.cases:
        row = run_case(name, args.steps, args.workdir)
        print(
            f"| {name} | {row['estimate_gib']} | {row['peak_gib']} | {row['estimate_over_peak']} "
            f"| {row['seconds_per_step']} |",
            flush=True,
        )
        if not args.no_record:
            record("training_memory", row)  # the row's own command (the recipe's) and date, and the machine
    return 0


if __name__ == "__main__":
    sys.exit(main())

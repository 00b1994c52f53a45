"""What the benchmark scripts share: round-robin timing, copy bandwidth, held-out perplexity and result records.

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, from benchmarks/<kind>/

    from benchmarks.common import interleaved_times, medians, copy_bandwidth, heldout_tokens, perplexities, record

Timing: `interleaved_times` calls every function once per round, round after round, so load from other processes
falls on all of them alike (timings on a shared machine can be bimodal across processes: compare side by side, in
the same processes, and report the spread); `median_seconds` times one function alone.

Held-out text (`heldout_tokens`, `perplexities`): the Python tutorial (`data/heldout/tutorial`, the text settings are
tuned on) and the Python HOWTOs (`data/heldout/howto`, the text that confirms them), non-overlapping 256-token
windows over the first 16384 tokens of each, scored as `llama-moe eval --window 256 --stride 256 --max-tokens 16384`
scores them (documents in file order, EOS between them). `data/` is not in git: each folder holds the `.rst.txt`
sources of CPython's `Doc/tutorial/` and `Doc/howto/` (Debian's python3.11-doc has them under
`usr/share/doc/python3.11/html/_sources/`). Both are Python documentation, the built-in calibration corpus's domain;
`OTHER_DOMAINS` (Debian's licences and manual pages, `data/heldout/licences`, `data/heldout/manpages`) confirm a claim
on text of other domains. `benchmarks/quality/make_heldout.py` writes all four.

Results: `record(name, numbers)` appends one JSON line (the command, the machine, the date and the numbers) to
`benchmarks/results/<name>.jsonl`; `benchmarks/tables.py` renders the docs' tables from those files.
"""

import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HELDOUT = ROOT / "data" / "heldout"
TEXTS = ("tutorial", "howto")
OTHER_DOMAINS = ("licences", "manpages")
WINDOW = 256
MAX_TOKENS = 16384
RUN = datetime.datetime.now().isoformat(timespec="seconds")  # rows one process records share it (tables.py)


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


def no_sync() -> None:
    """The synchronisation of a device whose calls return when done (CPU)."""


def synchronizer(device: str):
    """A function that waits for `device`'s queued work (CUDA), else one that does nothing."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return no_sync


def interleaved_times(
    functions: dict, rounds: int, warmup: int = 0, before=None, synchronize=no_sync, alternate: bool = False
) -> dict:
    """{name: seconds of each timed call}: every function called once per round, `warmup` rounds untimed first.
    `before(round_index)` runs before each call, untimed (e.g. writing a buffer larger than the caches, so each call
    reads its weights from memory); a function's own setup belongs there too, not in the timed call. `alternate`
    reverses the order every other round, so the order's own effects hit every function alike."""
    samples = {name: [] for name in functions}
    for round_index in range(warmup + rounds):
        names = list(functions)[:: -1 if alternate and round_index % 2 else 1]
        for name in names:
            if before is not None:
                before(round_index)
            synchronize()
            start = time.perf_counter()
            functions[name]()
            synchronize()
            if round_index >= warmup:
                samples[name].append(time.perf_counter() - start)
    return samples


def median_seconds(function, repeats: int, warmup: int = 1, synchronize=no_sync) -> float:
    """The median seconds of `repeats` calls of `function` after `warmup` untimed ones."""
    return statistics.median(interleaved_times({"f": function}, repeats, warmup, synchronize=synchronize)["f"])


def medians(samples: dict) -> dict:
    """{name: median} of {name: values}."""
    return {name: statistics.median(values) for name, values in samples.items()}


def copy_bandwidth(device: str = "cpu", megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s moved (read + written): the median of `repeats` copies of a float32 buffer far larger than the caches,
    with torch's threads (what a decoding step's weights are read with)."""
    import torch

    source = torch.randn(megabytes * 2**20 // 4, device=device)
    target = torch.zeros_like(source)  # written once, so no copy pays for first-touch page faults
    seconds = median_seconds(lambda: target.copy_(source), repeats, warmup=0, synchronize=synchronizer(device))
    return 2 * source.numel() * 4 / seconds / 1e9


# ---------------------------------------------------------------------------------------------------------------
# Held-out perplexity
# ---------------------------------------------------------------------------------------------------------------


def heldout_tokens(tokenizer, max_tokens: int = MAX_TOKENS, texts: tuple = TEXTS) -> dict:
    """The first `max_tokens` tokens `[N]` of each held-out text of `texts`."""
    from llama_moe.text.documents import iter_documents
    from llama_moe.text.tokens import token_stream

    missing = [name for name in texts if not (HELDOUT / name).is_dir()]
    if missing:
        raise SystemExit(f"{HELDOUT} lacks {missing}: write them with benchmarks/quality/make_heldout.py.")
    return {name: token_stream(iter_documents(str(HELDOUT / name)), tokenizer, max_tokens) for name in texts}


def perplexities(model, tokens: dict, batch_size: int = 8, window: int = WINDOW) -> dict:
    """{name: perplexity of `model` on tokens[name]}, over non-overlapping `window`-token windows (each window's
    first token is context only)."""
    from llama_moe.perplexity import sliding_window_perplexity

    return {
        name: sliding_window_perplexity(model, ids, window, window, batch_size).perplexity
        for name, ids in tokens.items()
    }


def kl_to_dense(model, dense, tokens: dict, batch_size: int = 8, window: int = WINDOW) -> dict:
    """{name: mean KL(dense || model) of the next-token distributions over tokens[name]}, in `window`-token rows (the
    remainder dropped): how far a converted model is from its source on each text, whatever the text's own loss."""
    import torch

    from llama_moe.distillation import distillation_kl

    result = {}
    for name, ids in tokens.items():
        rows = ids[: len(ids) // window * window].view(-1, window)  # [n, window]
        total = 0.0
        with torch.no_grad():
            for batch in rows.split(batch_size):
                # the dense logits again for each model: kept, a text's would take 3.2 GB (16,384 x 49,152 floats)
                total += distillation_kl(model(batch).logits, dense(batch).logits).sum().item()
        result[name] = total / rows.numel()
    return result


def chunk_perplexity(model, chunks, batch_size: int = 4) -> float:
    """Perplexity of `model` on the rows of `chunks` `[n, L]`, each scored on its own (L - 1 predictions a row)."""
    return perplexities(model, {"chunks": chunks.flatten()}, batch_size, chunks.shape[-1])["chunks"]


def recorded_calibration(model) -> str | None:
    """The calibration text a converted model's conversion recorded (None for a dense model)."""
    return (getattr(model.config, "conversion_info", None) or {}).get("calibration_data")


def report(label: str, result: dict, dense: dict) -> str:
    """One line: each text's perplexity and its ratio to the dense model's."""
    return f"{label}: " + ", ".join(f"{n} {result[n]:.3f} ({result[n] / dense[n]:.3f}x dense)" for n in result)


# ---------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------


def machine() -> str:
    """The machine in a few words: CPU model (or GPU name when CUDA is up) and core count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            name = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = ""
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        gpu = f", {sys.modules['torch'].cuda.get_device_name()}"
    return f"{name}, {os.cpu_count()} cores{gpu}"


def command_line() -> str:
    """The command that is running, as typed from the repository root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def record(name: str, numbers: dict, path: Path | None = None) -> dict:
    """Append `numbers` with this process's run, the command, machine and date to `benchmarks/results/<name>.jsonl`
    (or `path`); keys of `numbers` win (a row may carry its own command). `benchmarks/tables.py` shows the rows of a
    table's latest run."""
    today = datetime.date.today().isoformat()
    row = {"run": RUN, "command": command_line(), "machine": machine(), "date": today, **numbers}
    path = path or RESULTS / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as results:
        results.write(json.dumps(row) + "\n")
    return row

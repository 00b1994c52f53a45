"""The docs' benchmark tables, rendered from the JSON lines in benchmarks/results/ between markers:

    <!-- table: NAME -->
    | ... generated: do not edit by hand ... |
    <!-- /table -->

    python benchmarks/tables.py               # rewrite every marked table in docs/*.md and benchmarks/reports/*.md
    python benchmarks/tables.py --check       # exit 1, naming them, when a doc's tables differ from the results
    python benchmarks/tables.py --show decode # one table on stdout

A results row is one JSON object: `table` (the table it belongs to), `run` (rows recorded together share it), the
`command` that produced it, the `machine`, the `date`, and the numbers, keyed as the table's columns say. A table
shows the rows of its latest run, in file order. `benchmarks.common.record` appends rows with the command, machine
and date filled in. Rows transcribed from earlier docs keep the command and date their table was recorded with
(the date of the commit that added it where the docs gave none).

Some tables come from their scripts' own rows: `sparsity` (every row of results/sparsity.jsonl, by sparsity and then
the tutorial ratio), `forecast` (every row of results/forecast.jsonl with stage times), `training_memory` (the first
row of each case in results/training_memory.jsonl: the run of all cases; later single-case reruns stay in the file and
the prose), `btx` (results/btx.jsonl's last whole run, from its dense row, with the rows `btx_run.py eval --only`
rescored or added after it), `behaviour_choose` / `behaviour_confirm` (results/behaviour.jsonl's latest row of each
model on that prompt set), and from results/presets.jsonl `preset_speed` (the latest row of each preset and runtime:
what `llama-moe convert --help` quotes) and `preset_perplexity` (the latest row of each `sparse-N` preset per
calibration text, with its tasks row).
"""

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"  # the user pages
REPORTS = ROOT / "benchmarks" / "reports"  # the measurement history, a report per study
DOC_GLOBS = (DOCS, REPORTS)
MARKER = re.compile(r"^(<!-- table: (\S+) -->\n)(.*?)^(<!-- /table -->)$", re.DOTALL | re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Table:
    """A table of `file`'s rows: `columns` are (header, key, format); a format writes the key's number, or its
    list of numbers, back as the docs show it; None shows the value as it is (text)."""

    file: str
    align: str
    columns: list


def cell(value, form) -> str:
    if value is None:
        return ""
    if form is None:
        return str(value)
    return form.format(*value) if isinstance(value, list) else form.format(value)


def latest_run(rows: list[dict], name: str) -> list[dict]:
    """The rows of `name`'s latest run, in file order."""
    mine = [row for row in rows if row.get("table") == name]
    return [row for row in mine if row.get("run") == mine[-1].get("run")] if mine else []


def read_rows(file: str) -> list[dict]:
    path = RESULTS / file
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def markdown(headers: list[str], align: str, rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {text} " if text else " " for text in cells) + "|"

    return "\n".join([line(headers), align, *(line(cells) for cells in rows)])


def render_table(name: str) -> str:
    table = TABLES[name]
    rows = latest_run(read_rows(table.file), name)
    if not rows:
        raise SystemExit(f"benchmarks/results/{table.file} has no rows of table {name!r}")
    headers = [header for header, _, _ in table.columns]
    return markdown(
        headers, table.align, [[cell(row.get(key), form) for _, key, form in table.columns] for row in rows]
    )


# ---------------------------------------------------------------------------------------------------------------
# Tables from their scripts' own rows
# ---------------------------------------------------------------------------------------------------------------


SPARSITY_TEXTS = ("tutorial", "howto", "licences", "manpages")  # benchmarks/common.py's, the other domains last


def sparsity_table(rows: list[dict]) -> str:
    """benchmarks/quality/sparsity.py's rows: by sparsity, then the tutorial ratio."""
    lines = []
    for row in sorted(rows, key=lambda r: (r["sparsity"], r["ratio"]["tutorial"])):
        healed = f"{row['heal_tokens']:,}" if row["heal_tokens"] else "-"
        changed = " ".join(f"{name}={value}" for name, value in row.get("heal_fields", {}).items())
        method = row["method"] + (f", {row['shared']} shared" if "shared" in row else "")
        method += f", experts cut in {row['granularity']}" if "granularity" in row else ""
        router = row["router"] + ("" if row.get("compensation", True) else ", no compensation")
        router += f", calibrated on {Path(row['calibration_data']).stem}" if "calibration_data" in row else ""
        cells = [f"{row['sparsity']}%", method, router + (f" ({changed})" if changed else ""), healed]
        cells += [f"{row['ratio'][text]:.2f}x" if text in row["ratio"] else "-" for text in SPARSITY_TEXTS]
        lines.append([*cells, f"{row['seconds']:.0f}"])
    headers = ["active", "method", "router", "healed on", *SPARSITY_TEXTS, "build s"]
    return markdown(headers, "|---|---|---|---|---|---|---|---|---|", lines)


TRAINING_CASES = {  # case: (what runs, model and micro-batch), as docs/training.md names them
    "cpt-readme": ("continual pre-training, checkpointing (the README's CPU command)", "8x2, 1 x 1024"),
    "cpt-no-checkpointing": ("continual pre-training, no checkpointing", "8x2, 1 x 512"),
    "cpt-dense-batch4": ("continual pre-training", "dense, 4 x 1024"),
    "cpt-distill": ("continual pre-training distilled from the dense model", "8x2, 1 x 1024"),
    "cpt-adafactor": ("continual pre-training, Adafactor", "8x2, 2 x 1024"),
    "sft-stage1": ("SFT stage 1 (TRL's defaults: checkpointing, bf16 autocast)", "8x2, 1 x 1024"),
    "soap-small": ("SOAP pre-training (`soap-small.yaml`)", "4-layer SoapMoE, 4 x 1024"),
}


def training_memory_table(rows: list[dict]) -> str:
    """benchmarks/memory/training_memory.py's rows: the first of each case."""
    first = {}
    for row in rows:
        first.setdefault(row["case"], row)
    lines = [
        [*TRAINING_CASES.get(case, (case, "")), str(row["estimate_gib"]), f"{row['peak_gib']:.2f}"]
        + [f"{row['estimate_over_peak']:.2f}", str(row["seconds_per_step"])]
        for case, row in first.items()
    ]
    headers = ["case", "model, micro-batch", "estimate (GiB)", "peak (GiB)", "estimate / peak", "s / step"]
    return markdown(headers, "|---|---|---:|---:|---:|---:|", lines)


def forecast_table(rows: list[dict]) -> str:
    """benchmarks/memory/forecast_check.py's rows with stage times: forecast against measured, memory, each stage's
    time, disk."""
    lines = []
    for row in rows:
        if "seconds" not in row:  # rows from before the time forecast: memory only (the prose quotes them)
            continue
        memory, disk = row["memory"], row["disk"]
        times = [
            f"{stage} {t['forecast']:.0f} / {t['measured']:.0f} s ({t['ratio']:.2f})"
            for stage, t in row["seconds"].items()
        ]
        lines.append(
            [row["label"], f"{memory['forecast_gib']:.2f} / {memory['peak_gib']:.2f} ({memory['ratio']:.2f})"]
            + ["; ".join(times), f"{disk['forecast_gib']:.2f} / {disk['peak_gib']:.2f}", str(row["matmul_gflops"])]
            + [row["date"]]
        )
    headers = ["conversion", "memory GiB: forecast / peak", "time: forecast / measured", "disk GiB", "matmul GFLOP/s"]
    return markdown([*headers, "date"], "|---|---:|---|---:|---:|---|", lines)


BTX_TEXTS = ("prose", "code", "math", "mixture", "general")


def btx_table(rows: list[dict]) -> str:
    """benchmarks/quality/btx_run.py's rows (the latest of each model): perplexity per text, each stage's tokens and
    time."""
    mine = [row for row in rows if row.get("table") == "btx"]
    start = max(
        (i for i, row in enumerate(mine) if row["stage"] == "none"), default=0
    )  # a whole run scores dense first
    latest = {}
    for row in mine[start:]:
        latest[row["model"]] = row  # a later row (`--only`) replaces the model's earlier one and keeps its place
    lines = []
    for row in latest.values():
        seconds = "-" if row["stage_seconds"] is None else f"{row['stage_seconds']:.0f}"
        tokens = f"{row['train_tokens']:,}" if row["train_tokens"] else "-"
        cells = [row["model"], row["stage"], tokens, seconds]
        lines.append(cells + [f"{row['perplexity'][text]:.3f}" for text in BTX_TEXTS])
    headers = ["model", "stage", "stage tokens", "stage s", *BTX_TEXTS[:3], "mixture (3 domains)", "general (GPL-3)"]
    return markdown(headers, "|---|---|---:|---:|---:|---:|---:|---:|---:|", lines)


GPU_ATTN_MOE_PROBES = Table(
    "gpu_h200.jsonl",
    "|---|---|",
    [
        ("compiled decoding step of the 4-layer AttnMoE (bf16, H200)", "probe", None),
        ("logits vs eager", "logits_vs_eager", None),
    ],
)

BEHAVIOUR_TEXTS = {"choose": ("manpages",), "confirm": ("licences", "howto")}  # benchmarks/quality/behaviour.py


def behaviour_table(rows: list[dict], prompt_set: str) -> str:
    """benchmarks/quality/behaviour.py's rows of one prompt set, the latest of each model in its first place: the
    answers next to the dense model's, then KL, next-token agreement and perplexity ratio per text."""
    latest = {}
    for row in rows:
        if row.get("set") == prompt_set:
            latest[row["model"]] = row
    texts = BEHAVIOUR_TEXTS[prompt_set]
    headers = [
        "model",
        "answers as dense's (12 tokens)",
        "whole",
        "KL over dense's answers",
        "checkable right vs dense",
    ]
    for text in texts:
        headers += [f"{text} KL", f"{text} same next token", f"{text} perplexity vs dense"]
    return markdown(
        headers, "|---|" + "---:|" * (len(headers) - 1), [_behaviour_cells(r, texts) for r in latest.values()]
    )


def _behaviour_cells(row: dict, texts) -> list[str]:
    n = row["prompts"]
    cells = [
        f"`{row['model']}`",
        f"{row['answers_match_12']:.1%} ({round(row['answers_match_12'] * n)}/{n})",
        f"{row['answers_whole']:.1%}",
        f"{row['answer_kl']:.3f}",
        f"{row['accuracy_share']:.0%}",
    ]
    for text in texts:
        ratio = row[f"{text}_perplexity"] / row[f"{text}_dense_perplexity"]
        cells += [f"{row[f'{text}_kl']:.3f}", f"{row[f'{text}_agreement']:.1%}", f"{ratio:.2f}x"]
    return cells


RUNTIMES = ("transformers eager, cpu float32", "transformers compiled, cpu float32", "llama.cpp F16", "llama.cpp Q8_0")


def preset_speed_table(rows: list[dict]) -> str:
    """results/presets.jsonl's speed rows: the latest of each preset and runtime (a later line wins), the rule
    `llama-moe convert --help` quotes them by (`recipe.preset_measurements`), with the run each comes from."""
    latest = {}
    for row in rows:
        if row.get("kind") == "speed":
            latest[(row["preset"], row["runtime"])] = row
    order = {runtime: i for i, runtime in enumerate(RUNTIMES)}
    lines = []
    for (preset, runtime), row in sorted(latest.items(), key=lambda item: (item[0][0], order.get(item[0][1], 9))):
        cells = [f"`{preset}`", runtime, f"{row['decode_ratio']:.2f}x"]
        cells += [cell(row.get("prefill_ratio"), "{:.2f}x"), cell(row.get("limit_ratio"), "{:.2f}x"), row["run"]]
        lines.append(cells)
    headers = ["preset", "runtime", "decode vs dense", "512-token prefill vs dense", "bytes limit", "run"]
    runs = {row["run"]: row for row in latest.values()}
    commands = [[run, row["machine"], f"`{row['command']}`"] for run, row in sorted(runs.items())]
    return (
        markdown(headers, "|---|---|---:|---:|---:|---|", lines)
        + "\n\n"
        + markdown(["run", "machine", "command"], "|---|---|---|", commands)
    )


PRESET_TEXTS = ("tutorial", "howto", "licences", "manpages")  # benchmarks/quality/presets.py's held-out texts


def calibration_label(description: str | None) -> str:
    """The `--calibration-data` a recorded `conversion_info` description stands for (rows before the field: the
    default docstrings)."""
    if description is None or description.startswith("built-in corpus: "):
        return "`builtin:docstrings`"
    if description.startswith("built-in corpus, three kinds in turn"):  # builtin:mixed's first description
        return "`builtin:mixed`"
    match = re.match(r"built-in corpus ([\w-]+)", description)
    if match:
        return f"`builtin:{match[1]}`"
    return Path(description.removeprefix("local file ").split(" (")[0]).name


def own_calibration(preset: str) -> str:
    """The label of the calibration text preset `preset`'s recipe file names (`calibration_data`; none: docstrings)."""
    path = ROOT / "recipes" / "convert" / f"{preset}.yaml"
    match = re.search(r"^calibration_data:\s*(\S+)", path.read_text(), re.MULTILINE) if path.exists() else None
    return f"`{match[1]}`" if match else calibration_label(None)


def preset_perplexity_table(rows: list[dict]) -> str:
    """results/presets.jsonl's quality rows of the `sparse-N` presets on their own calibration text or on the
    docstrings (the presets' text until 2026-12): the latest per preset and text, with the multiple-choice share of
    the latest tasks row of the same preset and text."""
    quality, tasks = {}, {}
    for row in rows:
        if re.fullmatch(r"sparse-\d+", row.get("preset", "")) and row.get("kind") in ("quality", "tasks"):
            key = (row["preset"], calibration_label(row.get("calibration")))
            if key[1] in (calibration_label(None), own_calibration(key[0])):
                (quality if row["kind"] == "quality" else tasks)[key] = row
    lines = []
    for key in sorted(quality, key=lambda key: (int(key[0][7:]), quality[key]["run"])):
        row = quality[key]
        cells = [f"`{key[0]}`", key[1], *(cell(row["ratio"].get(text), "{:.2f}x") for text in PRESET_TEXTS)]
        minutes = row.get("convert_seconds")
        share = tasks[key]["share"].get("offline_continuation") if key in tasks else None
        lines.append([*cells, cell(share, "{:.1%}"), cell(minutes and minutes / 60, "{:.0f} min"), row["run"]])
    headers = ["preset", "calibrated on", *PRESET_TEXTS, "multiple choice vs dense", "conversion", "run"]
    return markdown(headers, "|---|---|---:|---:|---:|---:|---:|---:|---|", lines)


SCRIPT_TABLES = {
    "preset_speed": lambda: preset_speed_table(read_rows("presets.jsonl")),
    "preset_perplexity": lambda: preset_perplexity_table(read_rows("presets.jsonl")),
    "behaviour_choose": lambda: behaviour_table(read_rows("behaviour.jsonl"), "choose"),
    "behaviour_confirm": lambda: behaviour_table(read_rows("behaviour.jsonl"), "confirm"),
    "sparsity": lambda: sparsity_table([row for row in read_rows("sparsity.jsonl") if "method" in row]),
    "training_memory": lambda: training_memory_table(read_rows("training_memory.jsonl")),
    "btx": lambda: btx_table(read_rows("btx.jsonl")),  # the last whole run and the rows rescored after it
    "forecast": lambda: forecast_table(read_rows("forecast.jsonl")),
}


# ---------------------------------------------------------------------------------------------------------------
# The tables transcribed from the docs (and the scripts that record rows of the same columns)
# ---------------------------------------------------------------------------------------------------------------

TABLES = {
    "decode": Table(
        "decode.jsonl",
        "|---|---|---|---|---|---|",
        [
            ("model", "model", None),
            ("weight MB read per token", "weight_mb_read_per_token", "{:d}"),
            ("limit tokens/s", "limit_tokens_s", "{:.1f}"),
            ("decode tokens/s", "decode_tokens_s", "{:.1f}"),
            ("vs dense", "vs_dense", "{:.2f}x"),
            ("share of limit", "share_of_limit", "{:d}%"),
        ],
    ),
    "decode_steps": Table(
        "decode.jsonl",
        "|---|---|---|---|",
        [
            ("2/8 / dense, median (range over 3 processes)", "mode", None),
            ("all of `generate`", "all_of_generate", "{:.2f}x ({:.2f}-{:.2f}x)"),
            ("after the first token", "after_the_first_token", "{:.2f}x ({:.2f}-{:.2f}x)"),
            ("tokens/s after the first: dense, 2/8", "after_first_tokens_s", "{:.1f}, {:.1f}"),
        ],
    ),
    "decode_experts_compiled": Table(
        "decode.jsonl",
        "|---|---|---|---|---|",
        [
            ("decode tokens/s (2026-11-27, a slower machine than above)", "row", None),
            ("dense", "dense", "{:.1f}"),
            ("2/8", "2_8", None),
            ("4/8", "4_8", None),
            ("6/8", "6_8", None),
        ],
    ),
    "decode_step_profile": Table(
        "decode.jsonl",
        "|---|---|---|---|---|---|---|---|---|",
        [
            ("", "row", None),
            ("norms", "norms", "{:.2f}-{:.2f}"),
            ("attention", "attention", "{:.2f}-{:.2f}"),
            ("MLP", "mlp", "{:.2f}-{:.2f}"),
            ("of which router", "of_which_router", "{:.2f}-{:.2f}"),
            ("of which experts", "of_which_experts", "{:.2f}-{:.2f}"),
            ("LM head", "lm_head", "{:.2f}-{:.2f}"),
            ("rest", "rest", "{:.2f}-{:.2f}"),
            ("step", "step", "{:.2f}-{:.2f}"),
        ],
    ),
    "decode_prefill_profile": Table(
        "decode.jsonl",
        "|---|---|---|---|",
        [
            ("", "row", None),
            ("attention (of which q/k/v/o)", "attention", "{:.1f} ({:.1f})"),
            ("MLP (of which experts)", "mlp", None),
            ("total", "total", "{:.1f}"),
        ],
    ),
    "decode_compiled_profile": Table(
        "decode.jsonl",
        "|---|---|---|---|---|---|---|---|",
        [
            ("ms per step, 3 processes", "model", None),
            ("generated kernels", "generated_kernels", "{:.2f}-{:.2f}"),
            ("aten calls", "aten_calls", "{:.2f}-{:.2f}"),
            ("guards", "guards", "{:.2f}-{:.2f}"),
            ("graph wrapper", "graph_wrapper", "{:.2f}-{:.2f}"),
            ("rest and other", "rest_and_other", "{:.2f}-{:.2f}"),
            ("step", "step", "{:.2f}-{:.2f}"),
            ("outside the kernels", "outside_the_kernels", "{:.2f}-{:.2f}"),
        ],
    ),
    "linear_reduction": Table(
        "decode.jsonl",
        "|---|---|---|",
        [
            ("`[out, in]`, one row, compiled", "shape", None),
            ("`F.linear`", "f_linear", "{:.1f} us"),
            ("reduction", "reduction", "{:.1f} us"),
        ],
    ),
    "moe_layer": Table(
        "moe_layer.jsonl",
        "|---|---|---|---|---|---|",
        [
            ("tokens", "tokens", "{:d}"),
            ("dense", "dense", "{:.3f} ({:.2f})"),
            ("ours (llama_moe_auto)", "ours_llama_moe_auto", "{:.3f} ({:.2f})"),
            ("mixtral eager", "mixtral_eager", "{:.3f} ({:.2f})"),
            ("mixtral grouped_mm", "mixtral_grouped_mm", "{:.3f} ({:.2f})"),
            ("ours / ideal", "ours_ideal", "{:.2f}"),
        ],
    ),
    "moe_layer_runs": Table(
        "moe_layer.jsonl",
        "|---|---|---|---|",
        [
            ("tokens", "tokens", "{:d}"),
            ("run 1", "run_1", "{:.2f}; {:.2f}; {:.2f}"),
            ("run 2", "run_2", "{:.2f}; {:.2f}; {:.2f}"),
            ("run 3", "run_3", "{:.2f}; {:.2f}; {:.2f}"),
        ],
    ),
    "moe_layer_floor_1": Table(
        "moe_layer.jsonl",
        "|---|---|---|---|---|---|---|",
        [
            ("tokens", "tokens", "{:d}"),
            ("dense ms", "dense_ms", "{:.3f}"),
            ("expert matmuls", "expert_matmuls", "{:.3f}"),
            ("padded bmm", "padded_bmm", "{:.3f}"),
            ("one matmul", "one_matmul", "{:.3f}"),
            ("ours", "ours", "{:.3f}"),
            ("ours / expert matmuls", "ours_expert_matmuls", "{:.2f}"),
        ],
    ),
    "moe_layer_floor_2": Table(
        "moe_layer.jsonl",
        "|---|---|---|---|---|---|---|",
        [
            ("tokens", "tokens", "{:d}"),
            ("dense ms", "dense_ms", "{:.3f}"),
            ("expert matmuls", "expert_matmuls", "{:.3f}"),
            ("padded bmm", "padded_bmm", "{:.3f}"),
            ("one matmul", "one_matmul", "{:.3f}"),
            ("ours", "ours", "{:.3f}"),
            ("ours / expert matmuls", "ours_expert_matmuls", "{:.2f}"),
        ],
    ),
    "moe_layer_processes": Table(
        "moe_layer.jsonl",
        "|---|---|---|---|---|---|",
        [
            ("tokens", "tokens", "{:d}"),
            ("process 1", "process_1", "{:.2f}; {:.2f}; {:.2f}"),
            ("process 2", "process_2", "{:.2f}; {:.2f}; {:.2f}"),
            ("process 3", "process_3", "{:.2f}; {:.2f}; {:.2f}"),
            ("process 4", "process_4", "{:.2f}; {:.2f}; {:.2f}"),
            ("process 5", "process_5", "{:.2f}; {:.2f}; {:.2f}"),
        ],
    ),
    "attn_moe": Table(
        "attn_moe.jsonl",
        "|---|---|---|---|---|---|",
        [
            ("attention block", "attention_block", None),
            ("tokens", "tokens", "{:d}"),
            ("min time (ms)", "min_time_ms", "{:.1f}"),
            ("median (ms)", "median_ms", "{:.1f}"),
            ("min vs dense", "min_vs_dense", "{:.2f}x"),
            ("FLOPs vs dense", "flops_vs_dense", "{:d}%"),
        ],
    ),
    "soap_train": Table(
        "soap.jsonl",
        "|---|---|---|---|---|---|",
        [
            ("", "row", None),
            ("process 1", "process_1", None),
            ("process 2", "process_2", None),
            ("process 3", "process_3", None),
            ("process 4", "process_4", None),
            ("target (1.5 x E/S + 5%)", "target_1_5_x_e_s_5", "< {:.1f}%"),
        ],
    ),
    "soap_train_glibc": Table(
        "soap.jsonl",
        "|---|---|---|",
        [
            ("", "row", None),
            ("new", "new", None),
            ("before", "before", None),
        ],
    ),
    "gpu_h200_checks": Table(
        "gpu_h200.jsonl",
        "|---|---|",
        [
            ("check (bf16, H200)", "check_bf16_h200", None),
            ("result", "result", None),
        ],
    ),
    "gpu_h200_attn_moe": GPU_ATTN_MOE_PROBES,
    "gpu_h200_attn_moe_fourth_run": GPU_ATTN_MOE_PROBES,
    "gpu_h200_decode": Table(
        "gpu_h200.jsonl",
        "|---|---|---|---|---|",
        [
            ("H200, bf16, batch 1", "h200_bf16_batch_1", None),
            ("dense tokens/s", "dense_tokens_s", "{:.1f}"),
            ("2/8 tokens/s", "moe_2_8_tokens_s", "{:.1f}"),
            ("2/8 / dense", "moe_2_8_vs_dense", None),
            ("512-token prefill, 2/8 / dense", "prefill_2_8_vs_dense", "{:.2f}x"),
        ],
    ),
    "gpu_h200_moe_layer": Table(
        "gpu_h200.jsonl",
        "|---|---|---|---|---|---|",
        [
            ("tokens", "tokens", "{:d}"),
            ("dense", "dense", "{:.3f}"),
            ("ours (the default kernel)", "ours", "{:.3f} ({:.2f})"),
            ("Mixtral eager", "mixtral_eager", "{:.3f} ({:.2f})"),
            ("Mixtral `grouped_mm`", "mixtral_grouped_mm", "{:.3f} ({:.2f})"),
            ("ours / Mixtral's best", "ours_mixtral_s_best", "{:.2f}"),
        ],
    ),
    "cpu_dtype": Table(
        "cpu_dtype.jsonl",
        "|---|---:|---:|",
        [
            ("machine", "machine", None),
            ("float32 tokens/s", "float32_tokens_s", "{:.1f}, {:.1f}"),
            ("bfloat16 tokens/s", "bfloat16_tokens_s", "{:.1f}, {:.1f}"),
        ],
    ),
    "cli_start": Table(
        "cli_start.jsonl",
        "|---|---|---|---|",
        [
            ("command", "timed_command", "`{}`"),
            ("median", "median", "{:.2f}"),
            ("min", "min", "{:.2f}"),
            ("max", "max", "{:.2f}"),
        ],
    ),
    "test_command": Table(
        "test_command.jsonl",
        "|---|---|---|---|---|",
        [
            ("date", "date", None),
            ("machine", "machine", None),
            ("whole command", "whole_command", None),
            ("suite", "suite", None),
            ("smoke tests at the other ends (`tests/oldest_transformers.py` before 2026-11-28)", "other_ends", None),
        ],
    ),
    "convert_memory": Table(
        "convert_memory.jsonl",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        [
            ("source", "source", None),
            ("source GB", "source_gb", "{:.2f}"),
            ("files", "files", "{:d}"),
            ("read s", "read_s", "{:.1f}"),
            ("converted with", "convert", "`{}`"),
            ("convert s", "convert_s", "{:.1f}"),
            ("vs read", "vs_read", "{:.2f}x"),
            ("output GB", "output_gb", "{:.2f}"),
            ("peak RSS MB", "peak_rss_mb", "{:d} ({:+d} over the imports' {:d})"),
            ("peak anonymous MB", "peak_anon_mb", "{:d} ({:+d} over the imports)"),
        ],
    ),
    "soap_decode": Table(
        "soap.jsonl",
        "|---|---:|---:|",
        [
            ("model", "model", None),
            ("tokens/s", "tokens_s", "{:.1f}"),
            ("vs dense", "vs_dense", "{:+.1f}%"),
        ],
    ),
}


def render(name: str) -> str:
    if name in SCRIPT_TABLES:
        return SCRIPT_TABLES[name]()
    if name not in TABLES:
        raise SystemExit(f"unknown table {name!r}; known: {', '.join([*SCRIPT_TABLES, *TABLES])}")
    return render_table(name)


def doc_paths() -> list[Path]:
    """The Markdown files whose marked tables are generated: the user pages and the reports."""
    return [path for folder in DOC_GLOBS for path in sorted(folder.glob("*.md"))]


def update(path: Path, write: bool) -> list[str]:
    """The names of `path`'s marked tables that differ from their results; rewritten when `write`."""
    text = path.read_text()
    stale = []

    def replace(match) -> str:
        fresh = render(match.group(2)) + "\n"
        if match.group(3) != fresh:
            stale.append(match.group(2))
        return match.group(1) + fresh + match.group(4)

    new = MARKER.sub(replace, text)
    if write and new != text:
        path.write_text(new)
    return stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    parser.add_argument("--show", metavar="NAME", help="print one table and stop")
    parser.add_argument(
        "docs", nargs="*", type=Path, help="markdown files (default: docs/*.md and benchmarks/reports/*.md)"
    )
    args = parser.parse_args(argv)
    if args.show:
        print(render(args.show))
        return 0
    stale = {path: update(path, write=not args.check) for path in args.docs or doc_paths()}
    stale = {path: names for path, names in stale.items() if names}
    for path, names in stale.items():
        print(f"{path}: {'stale' if args.check else 'rewrote'} {', '.join(names)}")
    if args.check and stale:
        print("run `python benchmarks/tables.py` to regenerate them from benchmarks/results/", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quality at a given sparsity: every neuron-splitting method at 25%, 50% and 75% of the FFN active per token (shared
experts counted), training-free and healed, as held-out perplexity ratios to the dense SmolLM2-135M-Instruct.

Every row has 8 experts' worth of neurons per MoE layer (192 of the 1536): without shared experts top-2/4/6 of 8,
with one always-on shared expert 1 + top-1/3/5 of 7. All 30 layers are converted, with G-MoEfication's trained
selector router and compensation unless the row names another router. Calibration: the first 32768 tokens of the
built-in stdlib-docstring corpus (also what healing trains on). Scored on the Python tutorial (the text the settings
are chosen on) and the Python HOWTOs (the text that confirms them), `benchmarks/common.py`. Models are built in memory
by `build_moe` (the converter's own code path); rows that share calibration settings share one calibration context.
Each row is appended to `--output` (JSON lines) as soon as it is measured.

    python benchmarks/quality/sparsity.py --output sparsity.jsonl                           # the whole grid
    python benchmarks/quality/sparsity.py --methods cluster --sparsity 25 --heal 0 32768    # one method, with healing
    python benchmarks/quality/sparsity.py --methods residual --sparsity 75 --heal 32768 --heal-fields heal_schedule=cosine
    python benchmarks/quality/sparsity.py --table sparsity.jsonl                            # the rows as a markdown table
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import OTHER_DOMAINS, TEXTS, heldout_tokens, perplexities, record
from benchmarks.tables import sparsity_table
from llama_moe.checkpoints import default_model_path
from llama_moe.conversion.calibration import CalibrationContext
from llama_moe_hf import MoERecipe, build_moe

NUM_EXPERTS = 8
SHARED = {"random": 0, "cluster": 0, "sharing-inner": 0, "sharing-inter": 1, "residual": 1, "carve": 1}
OPTIONS = {"cluster": {"cluster_on": "activations"}}
CALIBRATION = dict(calibration_tokens=32768, calibration_samples=32768)


def row_fields(
    method: str, sparsity: int, router: str, shared: int | None = None, compensation: bool = True, granularity: int = 1
) -> dict:
    """The recipe fields of a row: `sparsity`% of the 8 experts' worth of neurons active, the shared ones included
    (`shared`: how many, default the method's `SHARED`); `granularity` G cuts each expert in G (fine-grained experts:
    8G experts, G times as many shared and chosen, the same neurons active)."""
    shared = (SHARED[method] if shared is None else shared) * granularity
    active = NUM_EXPERTS * granularity * sparsity // 100
    return dict(
        method=method,
        num_experts=NUM_EXPERTS * granularity - shared,
        num_shared_experts=shared,
        top_k=active - shared,
        router_init=router,
        compensation=compensation,
        options=OPTIONS.get(method, {}),
        **CALIBRATION,
    )


def measure(dense, tokenizer, context, tokens, fields: dict, heal: int, heal_fields: dict) -> dict:
    start = time.perf_counter()
    model = build_moe(dense, tokenizer=tokenizer, context=context, heal_tokens=heal, **fields, **heal_fields)
    seconds = time.perf_counter() - start
    result = perplexities(model, tokens)
    info = model.config.conversion_info.get("healing", {})
    return {"seconds": round(seconds, 1), "perplexity": result, "healing": info}


def field_value(text: str):
    """A number or boolean as JSON reads it, else the text itself (heal_schedule=cosine)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def print_table(paths: list[str]) -> None:
    """The rows of JSON-lines files as one markdown table, by sparsity, then tutorial ratio (the `sparsity` table of
    benchmarks/reports/sparsity-presets-history.md)."""
    rows = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if '"method"' in line]
    print(sparsity_table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(SHARED))
    parser.add_argument("--sparsity", nargs="+", type=int, default=[25, 50, 75])
    parser.add_argument("--routers", nargs="+", default=["selector"], help="router inits (analytical: carve only)")
    parser.add_argument("--heal", nargs="+", type=int, default=[0], help="heal tokens per row (0: training-free)")
    parser.add_argument(
        "--heal-fields", nargs="+", default=[], metavar="NAME=VALUE", help="healing fields of healed rows: heal_lr=1e-3"
    )
    parser.add_argument("--shared", type=int, help="shared experts of every row (default: 1 where the method has them)")
    parser.add_argument("--granularity", type=int, default=1, help="fine-grained experts: each of the 8 cut in G")
    parser.add_argument("--compensation", choices=("on", "off"), default="on", help="G-MoEfication's table")
    parser.add_argument("--calibration-data", help="calibration (and healing) text instead of the built-in corpus")
    parser.add_argument(
        "--texts", nargs="+", default=[*TEXTS, *OTHER_DOMAINS], help="held-out texts (benchmarks/common.py)"
    )
    parser.add_argument("--output", help="JSON lines, one per row")
    parser.add_argument("--table", nargs="+", help="print these JSON-lines files as a markdown table and stop")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.table:
        return print_table(args.table)
    if not args.output:
        parser.error("--output is required to measure")
    torch.set_num_threads(args.threads)
    heal_fields = {name: field_value(value) for name, value in (field.split("=", 1) for field in args.heal_fields)}
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = heldout_tokens(tokenizer, texts=tuple(args.texts))
    reference = perplexities(dense, tokens)
    print(json.dumps({"dense": reference}), flush=True)
    if args.calibration_data:
        CALIBRATION["calibration_data"] = str(Path(args.calibration_data).resolve())
    context = CalibrationContext(MoERecipe(**CALIBRATION), lambda *_: dense, lambda: tokenizer, device="cpu")
    for sparsity in args.sparsity:  # sparsity outermost: an interrupted grid has whole sparsities
        for method in args.methods:
            for router in args.routers:
                if router == "analytical" and method != "carve":
                    continue
                for heal in args.heal:
                    fields = row_fields(
                        method, sparsity, router, args.shared, args.compensation == "on", args.granularity
                    )
                    changed = heal_fields if heal else {}
                    row = {"method": method, "sparsity": sparsity, "router": router, "heal_tokens": heal}
                    if args.shared is not None:
                        row["shared"] = args.shared
                    if args.granularity != 1:
                        row["granularity"] = args.granularity
                    if args.compensation == "off":
                        row["compensation"] = False
                    if args.calibration_data:
                        row["calibration_data"] = args.calibration_data
                    row.update(measure(dense, tokenizer, context, tokens, fields, heal, changed))
                    if changed:
                        row["heal_fields"] = changed
                    row["ratio"] = {n: round(row["perplexity"][n] / reference[n], 3) for n in reference}
                    print(json.dumps(row), flush=True)
                    record("sparsity", row, Path(args.output))  # with the command, machine and date


if __name__ == "__main__":
    main()

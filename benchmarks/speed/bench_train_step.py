"""Training-step throughput and memory: converted MoE models against the dense model, in the same run.

    python benchmarks/speed/bench_train_step.py --moe outputs/smollm2-moe-2of8 [--batch 4 --length 256 --steps 4]

Each variant trains in its own fresh process (so peak memory is its own): the dense built-in model, every `--moe`
folder, and the dense model upcycled in memory to 8 experts top-2 (`--no-upcycle` skips it). A step is forward,
backward and AdamW on `batch x length` tokens of real text (stdlib docstrings), float32; the first step is a
warm-up. Reported: median step seconds, tokens/s, ratio to dense, peak resident memory (ru_maxrss), parameters.
The variants run in turn, `--repeats` times, so slow phases of the machine hit all of them.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import median_seconds

WORKER = "--worker"


def load(variant: str):
    from transformers import AutoModelForCausalLM

    import llama_moe_hf
    from llama_moe.checkpoints import default_model_path

    if variant not in ("dense", "upcycle-8x2"):  # a converted folder: only its own weights in this process
        return AutoModelForCausalLM.from_pretrained(variant, dtype=torch.float32)
    dense = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    if variant == "dense":
        return dense
    moe = llama_moe_hf.build_moe(dense, method="upcycle", num_experts=8, top_k=2)
    del dense
    return moe


def worker(variant: str, batch: int, length: int, steps: int) -> dict:
    from transformers import AutoTokenizer

    from llama_moe.checkpoints import default_model_path
    from llama_moe.text.corpus import stdlib_docstrings

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    ids = tokenizer("\n\n".join(stdlib_docstrings()[:400]), return_tensors="pt")["input_ids"][0]
    inputs = ids[: batch * length].view(batch, length)
    model = load(variant).train()
    if hasattr(model.config, "output_router_logits"):
        model.config.output_router_logits = True  # the balance loss, as the recipes train
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        model(input_ids=inputs, labels=inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {
        "variant": variant,
        "step_seconds": median_seconds(step, steps, warmup=1),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # ru_maxrss is in KiB
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moe", nargs="*", default=[], help="converted checkpoint folders to compare")
    parser.add_argument("--no-upcycle", action="store_true")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    variants = ["dense", *args.moe] + ([] if args.no_upcycle else ["upcycle-8x2"])
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for _ in range(args.repeats):
        for variant in variants:
            command = [sys.executable, __file__, WORKER, variant, str(args.batch), str(args.length), str(args.steps)]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[variant][-1]), flush=True)
    dense = statistics.median(run["step_seconds"] for run in runs["dense"])
    tokens = args.batch * args.length
    print(f"\n{tokens} tokens per step, median of {args.repeats} processes x {args.steps} steps\n")
    print("| model | parameters | step (s) | tokens/s | step vs dense | peak memory (GiB) |\n|---|---|---|---|---|---|")
    for variant, results in runs.items():
        step = statistics.median(run["step_seconds"] for run in results)
        spread = f"{min(r['step_seconds'] for r in results):.2f}-{max(r['step_seconds'] for r in results):.2f}"
        memory = max(run["peak_rss_gib"] for run in results)
        name = variant.rstrip("/").rsplit("/", 1)[-1]
        print(
            f"| {name} | {results[0]['parameters'] / 1e6:.1f}M | {step:.2f} ({spread}) | {tokens / step:.0f} "
            f"| {step / dense:.2f}x | {memory:.2f} |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER:
        variant, batch, length, steps = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(worker(variant, batch, length, steps)))
    else:
        main()

"""Routing analysis and evaluation of SmolLM2-135M-Instruct converted by random split, clustering (random router and
k-means router) and upcycling, on three domains of the offline data (docs/analysis.md).

    llama-moe offline-data --output data/offline
    python benchmarks/quality/routing_analysis.py --data data/offline --workdir outputs/analysis-demo

Runs, for each conversion, `llama-moe convert` (8 experts, top-2), `llama-moe analyze` on the train splits of
prose/code/math and `llama-moe eval` on their test splits (with the local lm-eval task), plus `llama-moe eval default`
for the dense model; a step whose output exists is not run again. Prints Markdown tables of the results and draws
the plots docs/analysis.md shows from the analysis.json files into --images.
"""

import argparse
import json
import subprocess
from pathlib import Path

CONVERSIONS = {
    "random split": ["--method", "random"],
    "clustering": ["--method", "cluster"],
    "clustering + k-means router": ["--method", "cluster", "--router-init", "kmeans"],
    "upcycling": ["--method", "upcycle"],
}
DOMAINS = ("prose", "code", "math")
THIRDS = ("layers 0-9", "layers 10-19", "layers 20-29")
SHOWN = {
    "upcycling": ("routing", "domain_distances"),
    "random split": ("routing",),
    "clustering + k-means router": ("routing",),
}


def slug(name: str) -> str:
    return name.replace(" + ", "-").replace(" ", "-")


def run(command: list[str], output: Path) -> None:
    if not output.exists():
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True)


def produce(data: Path, workdir: Path) -> None:
    domains = [f"{d}={data}/pretrain/{d}/train.jsonl" for d in DOMAINS]
    held_out = [f"{d}={data}/pretrain/{d}/test.jsonl" for d in DOMAINS]
    evaluate = ["--max-tokens", "8192", "--tasks", "llama_moe_arithmetic"]
    run(
        ["llama-moe", "eval", "default", "--data", *held_out, *evaluate, "--output", str(workdir / "eval-dense.json")],
        workdir / "eval-dense.json",
    )
    for name, flags in CONVERSIONS.items():
        model = workdir / slug(name)
        run(["llama-moe", "convert", "--output", str(model), "--num-experts", "8", "--top-k", "2", *flags], model)
        run(
            ["llama-moe", "analyze", str(model), "--data", *domains, "--output", str(model / "analysis")],
            model / "analysis",
        )
        run(["llama-moe", "eval", str(model), "--data", *held_out, *evaluate], model / "eval_results.json")


def thirds(values: list[float]) -> list[float]:
    size = len(values) // 3
    return [sum(values[i * size : (i + 1) * size]) / size for i in range(3)]


def off_diagonal(matrix: list[list[float]]) -> float:
    n = len(matrix)
    return sum(matrix[i][j] for i in range(n) for j in range(n) if i != j) / (n * (n - 1))


def tables(workdir: Path) -> str:
    dense = json.loads((workdir / "eval-dense.json").read_text())
    lines = [
        "| model | " + " | ".join(f"{d} ppl" for d in DOMAINS) + " | arithmetic acc | active params |",
        "|---" * (len(DOMAINS) + 3) + "|",
    ]
    rows = [("dense", dense)] + [
        (n, json.loads((workdir / slug(n) / "eval_results.json").read_text())) for n in CONVERSIONS
    ]
    for name, results in rows:
        ppl = " | ".join(f"{results['perplexity'][d]['perplexity']:.2f}" for d in DOMAINS)
        acc = results["lm_eval"]["llama_moe_arithmetic"]["acc"]
        lines.append(f"| {name} | {ppl} | {acc:.2f} | {results['parameters']['active'] / 1e6:.1f}M |")
    lines += [
        "",
        "| conversion | CV of load | entropy / log E | domain distance (" + ", ".join(THIRDS) + ") | "
        "weight cosine | output cosine | distance prose-code, prose-math, code-math |",
        "|---" * 7 + "|",
    ]
    for name in CONVERSIONS:
        report = json.loads((workdir / slug(name) / "analysis" / "analysis.json").read_text())
        summary, sites = report["summary"]["mlp"], report["sites"]
        distances = thirds([off_diagonal(s["domain_distances"]) for s in sites])
        pairs = [sum(s["domain_distances"][i][j] for s in sites) / len(sites) for i, j in ((0, 1), (0, 2), (1, 2))]
        lines.append(
            f"| {name} | {summary['mean_cv']:.3f} | {summary['mean_normalized_entropy']:.4f} | "
            + ", ".join(f"{d:.3f}" for d in distances)
            + f" | {summary['mean_weight_similarity']:.3f} | {summary['mean_output_similarity']:.3f} | "
            + ", ".join(f"{p:.3f}" for p in pairs)
            + " |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/offline"))
    parser.add_argument("--workdir", type=Path, default=Path("outputs/analysis-demo"))
    parser.add_argument("--images", type=Path, default=None, help="draw the plots here (docs/images)")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    produce(args.data, args.workdir)
    print(tables(args.workdir))
    if args.images:
        draw_plots(args.workdir, args.images)


def draw_plots(workdir: Path, images: Path) -> None:
    """The plots docs/analysis.md shows, drawn again from the analysis.json files."""
    from llama_moe.analysis.plots import distance_heatmaps, routing_heatmaps

    for name, plots in SHOWN.items():
        sites = json.loads((workdir / slug(name) / "analysis" / "analysis.json").read_text())["sites"]
        for plot in plots:
            draw = {"routing": routing_heatmaps, "domain_distances": distance_heatmaps}[plot]
            draw(sites, images / f"analysis_{slug(name)}_{plot}.png")


if __name__ == "__main__":
    main()

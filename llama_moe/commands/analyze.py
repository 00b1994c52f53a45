"""`llama-moe analyze`: how a MoE model routes each domain's text, with plots, JSON and a Markdown summary."""

import dataclasses

from ..analysis.options import AnalyzeOptions


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="routing statistics per layer and domain, expert similarity, plots (LlamaMoE, AttnMoE, SoapMoE)",
        description="Stream each domain's text through the model with hooks on its routers. Writes analysis.json "
        "(every number), PNG heatmaps (tokens per expert per domain, distances between domains' routing, expert "
        "similarity of weights and outputs) and summary.md to --output. Put it in MODEL/analysis and `llama-moe push` "
        "shows the routing plot on the model card.",
        dataclass_types=[AnalyzeOptions],
    )
    parser.add_argument("model", help="a converted model: local folder, Hub id ORG/NAME")


def run(args) -> None:
    from ..analysis.analyze import analyze

    options = AnalyzeOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(AnalyzeOptions)})
    report = analyze(args.model, options)
    for kind, summary in report["summary"].items():
        values = {key: f"{value:.3f}" for key, value in summary.items() if key != "sites" and value is not None}
        print(f"{kind} ({summary['sites']} layers): " + ", ".join(f"{key} {value}" for key, value in values.items()))
    print(f"wrote {options.output}: analysis.json, summary.md, {', '.join(report['plots'])}")

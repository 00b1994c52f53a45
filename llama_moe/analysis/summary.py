"""summary.md: the analysis in a page (a table per kind of routed site, the plots, how to read them)."""

from .report import off_diagonal_mean

KIND_TITLES = {"mlp": "MLP experts", "attention": "Attention experts", "soap": "SOAP layers"}
COLUMNS = (
    ("CV of load", lambda s: s["all"]["cv"]),
    ("entropy / log E", lambda s: s["all"]["normalized_entropy"]),
    ("dropped", lambda s: s["all"]["dropped_share"]),
    ("utilisation", lambda s: s["all"].get("utilization")),
    ("domain distance", lambda s: off_diagonal_mean(s["domain_distances"])),
    ("weight cosine", lambda s: off_diagonal_mean(s["weight_similarity"])),
    ("output cosine", lambda s: off_diagonal_mean(s["output_similarity"])),
)
READING = (
    "CV of load: standard deviation over mean of the load per expert (0 = perfectly balanced). "
    "Entropy / log E: mean routing entropy over its maximum (1 = uniform routing, 0 = one expert per token). "
    "Dropped: share of tokens no expert takes under the gate's capacity (expert choice only). "
    "Utilisation: share of (segment, expert) routing weights at or above the threshold (SOAP only). "
    "Domain distance: mean L2 distance between domains' normalised load distributions (LLaMA-MoE Fig. 9). "
    "Weight / output cosine: mean pairwise cosine similarity of the experts' weights, and of their outputs on the data."
)


def _cell(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary_markdown(report: dict) -> str:
    domains = ", ".join(f"{name} ({d['tokens']:,} tokens, {d['source']})" for name, d in report["domains"].items())
    lines = [f"# Routing analysis: {report.get('model', report['family'])}", "", f"Data: {domains}.", "", READING, ""]
    for kind, summary in report["summary"].items():
        sites = [site for site in report["sites"] if site["kind"] == kind]
        columns = [(name, get) for name, get in COLUMNS if any(get(site) is not None for site in sites)]
        lines += [f"## {KIND_TITLES.get(kind, kind)} ({summary['sites']} layers)", ""]
        lines += ["| layer | " + " | ".join(name for name, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
        lines += [f"| {s['layer']} | " + " | ".join(_cell(get(s)) for _, get in columns) + " |" for s in sites]
        lines += [""] + [f"![{plot}]({plot})" for plot in report.get("plots", []) if plot.endswith(f"_{kind}.png")]
        lines.append("")
    return "\n".join(lines)

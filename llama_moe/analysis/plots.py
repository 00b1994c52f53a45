"""PNG plots of an analysis: one panel per routed site, in grids of a fixed panel size (so an image's size follows
from its panel count: `image_size`). matplotlib's object API, no pyplot: no global state, no display needed."""

import math
from pathlib import Path

PANEL_INCHES = (2.6, 2.2)
COLUMNS = 6
DPI = 100


def image_size(panels: int) -> tuple[int, int]:
    """(width, height) in pixels of a grid of `panels` panels."""
    columns = min(panels, COLUMNS)
    rows = math.ceil(panels / columns)
    return round(columns * PANEL_INCHES[0] * DPI), round(rows * PANEL_INCHES[1] * DPI)


def _grid(panels: int, title: str):
    from matplotlib.figure import Figure

    columns = min(panels, COLUMNS)
    rows = math.ceil(panels / columns)
    figure = Figure(figsize=(columns * PANEL_INCHES[0], rows * PANEL_INCHES[1]), dpi=DPI, layout="constrained")
    figure.suptitle(title, fontsize=9)
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    for unused in axes[panels:]:
        unused.set_axis_off()
    return figure, axes[:panels]


def _largest(matrices) -> float:
    """One colour scale for every panel of a grid, so layers compare by colour."""
    return max(max(max(row) for row in matrix) for matrix in matrices)


def _heatmap(axis, matrix, title: str, rows: list[str] | None, vmin=None, vmax=None, cmap="viridis"):
    image = axis.imshow(matrix, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    axis.set_title(title, fontsize=7)
    axis.tick_params(labelsize=5)
    axis.set_yticks(range(len(matrix)), rows if rows else [str(i) for i in range(len(matrix))])
    width = len(matrix[0])
    axis.set_xticks(range(0, width, max(1, width // 8)))  # integer experts, at most about 8 labels
    axis.figure.colorbar(image, ax=axis, shrink=0.8).ax.tick_params(labelsize=5)


def routing_heatmaps(sites: list[dict], path: Path) -> None:
    """Share of each domain's load per expert (LLaMA-MoE Fig. 8): rows domains, columns experts."""
    figure, axes = _grid(len(sites), f"{sites[0]['kind']} routing: share of each domain's {sites[0]['load_unit']}")
    matrices = [[site["domains"][name]["load_share"] for name in site["domains"]] for site in sites]
    vmax = _largest(matrices)
    for axis, site, matrix in zip(axes, sites, matrices):
        _heatmap(axis, matrix, site["name"], list(site["domains"]), vmin=0.0, vmax=vmax)
        axis.set_xlabel("expert", fontsize=6)
    figure.savefig(path, dpi=DPI)


def distance_heatmaps(sites: list[dict], path: Path) -> None:
    """L2 distance between domains' routing distributions (LLaMA-MoE Fig. 9)."""
    figure, axes = _grid(len(sites), f"{sites[0]['kind']} routing: distance between domains")
    vmax = _largest([site["domain_distances"] for site in sites])
    for axis, site in zip(axes, sites):
        domains = list(site["domains"])
        _heatmap(axis, site["domain_distances"], site["name"], domains, vmin=0.0, vmax=vmax, cmap="magma")
        axis.set_xticks(range(len(domains)), domains, rotation=90)
    figure.savefig(path, dpi=DPI)


def similarity_heatmaps(sites: list[dict], path: Path) -> None:
    """Expert cosine similarity: below the diagonal of the weights, above it of the outputs on the data."""
    figure, axes = _grid(len(sites), f"{sites[0]['kind']} experts: cosine of weights (lower) and outputs (upper)")
    for axis, site in zip(axes, sites):
        weights, outputs = site["weight_similarity"], site["output_similarity"]
        size = len(weights)
        matrix = [[weights[i][j] if i > j else outputs[i][j] for j in range(size)] for i in range(size)]
        _heatmap(axis, matrix, site["name"], None, vmin=-1.0, vmax=1.0, cmap="coolwarm")
        axis.set_xlabel("expert", fontsize=6)
    figure.savefig(path, dpi=DPI)


PLOTS = {"routing": routing_heatmaps, "domain_distances": distance_heatmaps, "expert_similarity": similarity_heatmaps}


def write_plots(sites: list[dict], folder: Path) -> list[str]:
    """Every plot for every kind of site; returns the file names written."""
    names = []
    for kind in dict.fromkeys(site["kind"] for site in sites):
        of_kind = [site for site in sites if site["kind"] == kind]
        for plot, draw in PLOTS.items():
            names.append(f"{plot}_{kind}.png")
            draw(of_kind, folder / names[-1])
    return names

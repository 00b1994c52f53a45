"""The numbers of an analysis, from the recorder's sums: per site and domain, per site, and per kind of site."""

import torch

from .probes import Probe, Site
from .statistics import OutputProducts, RoutingTotals, routing_entropy_bound


def routing_metrics(totals: RoutingTotals, threshold: float | None) -> dict:
    """Load per expert (tokens, or SOAP routing weight), its shares and coefficient of variation, mean routing
    entropy (nats, and over its maximum log E), share of units dropped under a capacity, and SOAP utilisation."""
    load, units = totals.load, max(totals.units, 1)
    share = load / load.sum().clamp_min(1e-30)
    metrics = {
        "units": totals.units,
        "load": load.tolist(),
        "load_share": share.tolist(),
        "cv": float(load.std(unbiased=False) / load.mean().clamp_min(1e-30)),
        "entropy": totals.entropy / units,
        "normalized_entropy": totals.entropy / units / routing_entropy_bound(totals.num_experts),
        "dropped_share": None if totals.dropped is None else totals.dropped / units,
    }
    if threshold is not None:
        metrics["mean_routing_weight"] = (load / units).tolist()
        metrics["utilization"] = float(totals.above.sum() / (units * totals.num_experts))
    return metrics


def combined(totals: list[RoutingTotals]) -> RoutingTotals:
    """The totals of several domains as one."""
    merged = RoutingTotals(totals[0].num_experts)
    for part in totals:
        merged.units += part.units
        merged.entropy += part.entropy
        merged.load += part.load
        merged.above += part.above
        if part.dropped is not None:
            merged.dropped = (merged.dropped or 0) + part.dropped
    return merged


def domain_distances(per_domain: dict[str, RoutingTotals]) -> list[list[float]]:
    """L2 distance between the domains' normalised load distributions (LLaMA-MoE Fig. 9), `[D, D]`."""
    shares = torch.stack([t.load / t.load.sum().clamp_min(1e-30) for t in per_domain.values()])
    return torch.cdist(shares[None], shares[None])[0].tolist()


def cosine_matrix(rows: torch.Tensor) -> list[list[float]]:
    """Pairwise cosine similarity of `[E, P]` rows."""
    rows = rows.double()
    rows = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return (rows @ rows.T).tolist()


def site_report(probe: type[Probe], site: Site, per_domain: dict, products: OutputProducts, threshold) -> dict:
    return {
        "name": site.name,
        "layer": site.layer,
        "kind": site.kind,
        "num_experts": site.num_experts,
        "top_k": site.top_k,
        "load_unit": probe.load_name,
        "domains": {name: routing_metrics(totals, threshold) for name, totals in per_domain.items()},
        "all": routing_metrics(combined(list(per_domain.values())), threshold),
        "domain_distances": domain_distances(per_domain),
        "weight_similarity": cosine_matrix(probe.expert_weights(site).detach()),
        "output_similarity": products.cosine().tolist(),
        "output_similarity_units": products.units,
    }


def off_diagonal_mean(matrix: list[list[float]]) -> float | None:
    size = len(matrix)
    if size < 2:
        return None
    return sum(matrix[i][j] for i in range(size) for j in range(size) if i != j) / (size * (size - 1))


def kind_summary(sites: list[dict]) -> dict:
    """Means over the sites of one kind: what the Markdown summary and a quick look need."""

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    return {
        "sites": len(sites),
        "mean_cv": mean(s["all"]["cv"] for s in sites),
        "mean_normalized_entropy": mean(s["all"]["normalized_entropy"] for s in sites),
        "mean_dropped_share": mean(s["all"]["dropped_share"] for s in sites),
        "mean_domain_distance": mean(off_diagonal_mean(s["domain_distances"]) for s in sites),
        "mean_weight_similarity": mean(off_diagonal_mean(s["weight_similarity"]) for s in sites),
        "mean_output_similarity": mean(off_diagonal_mean(s["output_similarity"]) for s in sites),
        "mean_utilization": mean(s["all"].get("utilization") for s in sites),
    }

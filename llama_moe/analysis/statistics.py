"""Running sums of what the routers did, per routed site and domain, and of the experts' output products.

Memory is a few `[E]` and `[E, E]` tensors per site and domain, whatever the amount of data: every forward adds into
them and is dropped.
"""

import contextlib
import math
from dataclasses import dataclass, field

import torch

from .probes import Probe, Routing, Site


@dataclass
class RoutingTotals:
    """One site on one domain. `load` [E]: summed `Routing.load`; `entropy`: summed routing entropy (nats);
    `above` [E]: units whose load on the expert reached the probe's utilisation threshold (SOAP)."""

    num_experts: int
    units: int = 0
    entropy: float = 0.0
    dropped: int | None = None
    load: torch.Tensor = None
    above: torch.Tensor = None

    def __post_init__(self):
        self.load = torch.zeros(self.num_experts, dtype=torch.float64)
        self.above = torch.zeros(self.num_experts, dtype=torch.float64)

    def add(self, routing: Routing, threshold: float | None) -> None:
        probs = routing.probs.float()
        self.units += probs.shape[0]
        self.entropy += float(-(probs * probs.clamp_min(1e-12).log()).sum())
        self.load += routing.load.double().sum(0).cpu()
        if threshold is not None:
            self.above += (routing.load >= threshold).double().sum(0).cpu()
        if routing.dropped is not None:
            self.dropped = (self.dropped or 0) + routing.dropped


@dataclass
class OutputProducts:
    """`gram[i, j]` = sum over units of <output_i, output_j>: the experts' output cosine similarity, streamed."""

    num_experts: int
    units: int = 0
    gram: torch.Tensor = None

    def __post_init__(self):
        self.gram = torch.zeros(self.num_experts, self.num_experts, dtype=torch.float64)

    def add(self, outputs: torch.Tensor) -> None:  # [E, N, H]
        flat = outputs.flatten(1).double()
        self.gram += (flat @ flat.T).cpu()
        self.units += outputs.shape[1]

    def cosine(self) -> torch.Tensor:
        norms = self.gram.diagonal().clamp_min(1e-30).sqrt()
        return self.gram / norms[:, None] / norms[None, :]


@dataclass
class Recorder:
    """Hooks on every site: routing into `totals[site][domain]`, expert outputs into `products[site]` until each
    site has seen `similarity_units` units."""

    sites: list[tuple[type[Probe], Site]]
    similarity_units: int
    thresholds: dict[str, float | None]
    domain: str = ""
    totals: dict[str, dict[str, RoutingTotals]] = field(default_factory=dict)
    products: dict[str, OutputProducts] = field(default_factory=dict)

    @contextlib.contextmanager
    def hooks(self):
        handles = []
        for probe, site in self.sites:
            self.totals[site.name] = {}
            self.products[site.name] = OutputProducts(site.num_experts)
            handles.append(site.gate.register_forward_hook(self._routing_hook(probe, site)))
            handles.append(site.block.register_forward_pre_hook(self._outputs_hook(probe, site), with_kwargs=True))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _routing_hook(self, probe: type[Probe], site: Site):
        def hook(module, args, output):
            totals = self.totals[site.name].setdefault(self.domain, RoutingTotals(site.num_experts))
            totals.add(probe.routing(site, output), self.thresholds.get(site.kind))

        return hook

    def _outputs_hook(self, probe: type[Probe], site: Site):
        def hook(module, args, kwargs):
            products = self.products[site.name]
            remaining = self.similarity_units - products.units
            if remaining > 0:
                products.add(probe.expert_outputs(site, args, kwargs, remaining))

        return hook


def routing_entropy_bound(num_experts: int) -> float:
    """The largest routing entropy (uniform routing), to normalise entropies to [0, 1]."""
    return math.log(num_experts) if num_experts > 1 else 1.0

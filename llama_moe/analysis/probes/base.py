"""What every probe provides: the routed sites of a model, what a router's output says, and the experts' weights and
outputs. One probe per kind of routed block (MoE MLP, attention experts, SOAP); `find_sites` asks them all."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

PROBES: dict[str, type["Probe"]] = {}


def register_probe(kind: str) -> Callable:
    def decorator(cls):
        cls.kind = kind
        PROBES[kind] = cls
        return cls

    return decorator


@dataclass
class Routing:
    """One forward of one router over N routed units (tokens, or SOAP segments).

    probs [N, E]  the router's softmax over all experts (entropy is measured on it)
    load  [N, E]  what each unit gives each expert: 1 per selected expert (token choice), or the merge weight (SOAP)
    dropped       units no expert would take under the gate's capacity (expert choice); None for gates without one
    """

    probs: torch.Tensor
    load: torch.Tensor
    dropped: int | None = None


@dataclass
class Site:
    """A routed block: `layer`'s router `gate` and the experts it routes, of the probe's `kind`."""

    name: str
    layer: int
    kind: str
    block: nn.Module
    gate: nn.Module
    num_experts: int
    top_k: int


class Probe:
    kind: str
    load_name = "tokens"  # what the load counts, for plots and the summary

    @staticmethod
    def sites(model) -> list[Site]:
        raise NotImplementedError

    @staticmethod
    def routing(site: Site, gate_output: tuple) -> Routing:
        raise NotImplementedError

    @staticmethod
    def expert_weights(site: Site) -> torch.Tensor:
        """`[E, P]`: each expert's own weights, flattened (cosine similarity of experts)."""
        raise NotImplementedError

    @staticmethod
    def expert_outputs(site: Site, args: tuple, kwargs: dict, limit: int) -> torch.Tensor:
        """`[E, N, H]`: every expert's output on (at most `limit` of) the N units of the block input `args, kwargs`,
        whatever the router chose."""
        raise NotImplementedError


def find_sites(model) -> list[tuple[type[Probe], Site]]:
    """Every routed block of `model` with the probe that reads it, in layer order."""
    found = [(probe, site) for probe in PROBES.values() for site in probe.sites(model)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no routed blocks; `analyze` reads MoE models ({', '.join(PROBES)})."
        )
    return sorted(found, key=lambda pair: (pair[1].layer, pair[1].kind))


def fused_expert_weights(experts: nn.Module) -> torch.Tensor:
    """`[E, P]`: each expert's gate, up and down weights of fused `gate_up_proj [E, 2m, H]` / `down_proj [E, H, m]`."""
    return torch.cat([experts.gate_up_proj.flatten(1), experts.down_proj.flatten(1)], dim=1).float()


def swiglu_expert(experts: nn.Module, states: torch.Tensor, e: int) -> torch.Tensor:
    """Expert `e` of fused `gate_up_proj [E, 2m, H]` / `down_proj [E, H, m]` experts on `[N, H]` states: `[N, H]`."""
    from llama_moe_hf.modeling.moe_kernels import swiglu_linear

    return swiglu_linear(states, experts.gate_up_proj[e], experts.down_proj[e], experts.act_fn)


def one_hot_load(index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[N, k]` selected experts -> `[N, E]` 0/1 selection."""
    return torch.zeros(index.shape[0], num_experts, device=index.device).scatter_(1, index, 1.0)


def capacity_dropped(probs: torch.Tensor, capacity: int) -> int:
    """Units that no expert takes when each expert takes its `capacity` most probable units (expert choice)."""
    taken = torch.zeros(probs.shape[0], dtype=torch.bool, device=probs.device)
    taken[probs.t().topk(capacity, dim=-1).indices.flatten()] = True
    return int((~taken).sum())

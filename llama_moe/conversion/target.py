"""What the components of a conversion share: the block they turn into experts with its resolved settings, and one
layer's work in progress."""

from dataclasses import dataclass, field
from typing import Any

MLP, ATTENTION = "mlp", "attention"
BLOCKS = {MLP: "mlp", ATTENTION: "self_attn"}  # the module of a decoder layer each kind of target converts


@dataclass(frozen=True)
class Target:
    """One block of the decoder layers that becomes experts (`mlp` or `attention`), with its resolved settings: the
    plan's names, which `settings.Part` maps to the recipe fields of each family."""

    kind: str
    method: str
    router_init: str
    router_type: str
    num_experts: int
    top_k: int
    num_shared_experts: int
    score_scale_factor: float
    layers: tuple[int, ...]


@dataclass
class LayerBuild:
    """One layer's block on its way to experts.

    dense:   the dense block's tensors, keyed under the block (`gate_proj.weight`, or `q_proj.weight`, ...)
    tensors: what the method made of them, keyed under the block (`experts.gate_up_proj`, ...)
    split:   the dense neurons of each expert (`ExpertSplit`), for methods that split the neurons
    """

    dense: dict[str, Any]
    tensors: dict[str, Any] = field(default_factory=dict)
    split: Any = None


def layer_seed(seed: int, layer_idx: int, stream: int) -> int:
    """Independent, reproducible seeds per (conversion seed, layer, purpose): results do not depend on layer order."""
    import numpy as np

    return int(np.random.SeedSequence([seed, layer_idx, stream]).generate_state(1)[0])


# Random streams of `layer_seed`, one per purpose.
SPLIT_STREAM, ROUTER_STREAM, SELECTOR_STREAM, ATTENTION_ROUTER_STREAM = 0, 1, 2, 3

"""What the components of a conversion share: the block they turn into experts, where a recipe holds its settings,
and one layer's work in progress."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MLP, ATTENTION = "mlp", "attention"
BLOCKS = {MLP: "mlp", ATTENTION: "self_attn"}  # the module of a decoder layer each kind of target converts


@dataclass(frozen=True)
class BlockSettings:
    """One block's settings as a recipe gives them, by role (None: left to the components' defaults)."""

    method: str | None = None
    router_init: str | None = None
    router_type: str | None = None
    num_experts: int | None = None
    top_k: int | None = None
    num_shared_experts: int | None = None
    score_scale_factor: float | list[float] | None = None
    layers: list[str] | None = None


ROLES = tuple(f.name for f in dataclasses.fields(BlockSettings))


@dataclass(frozen=True)
class Part:
    """A block that becomes experts (`kind`) and the typed settings dataclasses a recipe holds its settings in: their
    fields marked with a role (`role="num_experts"` in the field's metadata), the later dataclasses' over the
    earlier's. `without`: roles the part does not have (SoapMoE's MLP has no gate type)."""

    kind: str
    settings_classes: tuple[type, ...]
    without: tuple[str, ...] = ()

    def fields(self) -> dict[str, str]:
        """role -> the recipe field or component option that holds it."""
        found = {}
        for settings_class in self.settings_classes:
            found |= {f.metadata["role"]: f.name for f in dataclasses.fields(settings_class) if "role" in f.metadata}
        return {role: name for role, name in found.items() if role not in self.without}

    def settings(self, recipe) -> BlockSettings:
        """The part's settings in `recipe` (an option not set yet reads None)."""
        return BlockSettings(**{role: _read(recipe, name) for role, name in self.fields().items()})

    def with_settings(self, recipe, **values):
        """`recipe` with these roles' settings replaced (roles the part does not have are left out)."""
        names = {self.fields()[role]: value for role, value in values.items() if role in self.fields()}
        fields = {name: value for name, value in names.items() if name in recipe.__dataclass_fields__}
        options = {name: value for name, value in names.items() if name not in fields}
        return dataclasses.replace(recipe, **fields, options={**recipe.options, **options})


def _read(recipe, name: str):
    return getattr(recipe, name) if name in recipe.__dataclass_fields__ else recipe.options.get(name)


@dataclass(frozen=True)
class Target:
    """One block of the decoder layers that becomes experts (`mlp` or `attention`), with its resolved settings."""

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

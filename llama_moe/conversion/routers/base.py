"""Base class of the router initialisations: where the weights of a new router come from."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..registry import NoOptions, component_options
from ..target import ATTENTION, ATTENTION_ROUTER_STREAM, MLP, ROUTER_STREAM, LayerBuild, Target, layer_seed


class RouterInit:
    """The initial weights of one block's routers (`target`: MLP or attention). Subclass, set `description`, and
    register with `@ROUTER_INITS.register(name)`. The conversion calls `request(context)`, `prepare(context)`, then
    `tensors(layer_idx, built, context)` per converted layer (after the construction method built its experts)."""

    name = ""  # set by ROUTER_INITS.register
    description = ""  # one sentence: the card, `--help` and `info` show it
    Options = NoOptions
    targets = (MLP, ATTENTION)  # the blocks whose routers it can initialise
    router_type: str | None = None  # the one gate it makes (None: any token-choice gate)
    needs_neuron_split = False  # works only on experts that are subsets of the dense neurons
    needs_representatives = False  # works only on splits with a representative neuron per expert
    unit_weights = False  # its gate gives every selected expert weight 1 (the default score scale is then 1)
    even_weights = False  # a renormalised top-k whose k weights it keeps near 1/k (the default score scale is then k)
    needs_expert_inputs = False  # a merge's: reads each expert model's prompts or data (`expert_inputs`)
    mix_stage = False  # a merge trains its rows once the folder is written (BTX's MiX: `merging.mix`)

    def __init__(self, recipe, target: Target, dense_config, run=None):
        self.recipe, self.target, self.dense_config, self.run = recipe, target, dense_config, run
        self.options = component_options(type(self), recipe.options)

    @classmethod
    def check_experts(cls, experts) -> None:
        """A merge's check, before any model is opened: one ValueError for an expert model (`ExpertInputs.experts`)
        this init cannot start a row for (no prompts, no data)."""

    def request(self, context) -> None:
        """Ask `context` for the calibration statistics `prepare` and `tensors` will use."""

    def prepare(self, context) -> None:
        """Compute what every layer needs, before the dense model is released."""

    def generator(self, layer_idx: int):
        """A torch generator seeded for this layer's router (the recipe's seed, the layer, MLP or attention)."""
        import torch

        stream = ATTENTION_ROUTER_STREAM if self.target.kind == ATTENTION else ROUTER_STREAM
        return torch.Generator().manual_seed(layer_seed(self.recipe.seed, layer_idx, stream))

    def tensors(self, layer_idx: int, built: LayerBuild, context) -> dict:
        """The router's tensors of one layer, keyed under the router (`weight`, ...), in float32."""
        raise NotImplementedError

    def info(self) -> dict:
        """Extra `conversion_info` entries."""
        return {}


@dataclass(frozen=True)
class ExpertInputs:
    """What a merge (`llama-moe merge`) gives the router inits that start each expert model's router rows from that
    model's own text (`needs_expert_inputs`): `context.expert_inputs`.

    experts: per expert model, its `positive_prompts`, `negative_prompts` and `data` (`merging.config.ExpertSource`).
    experts_per_model: router rows per expert model (its experts are consecutive).
    source: the base model, read a tensor at a time (its hidden states give the gate vectors).
    """

    experts: tuple
    experts_per_model: int
    source: Any
    load_tokenizer: Callable
    hidden_token: str = "last"
    gate_tokens: int = 4096
    device: str | None = None


def expert_inputs(context, router) -> ExpertInputs:
    """`context.expert_inputs`, or one ValueError saying that `router` is a merge's router init."""
    inputs = getattr(context, "expert_inputs", None)
    if inputs is None:
        raise ValueError(
            f"Router init {router.name!r} starts each expert's router row from that expert model's prompts or data: "
            "use it with `llama-moe merge`."
        )
    return inputs

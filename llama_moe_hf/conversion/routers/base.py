"""Base class of the router initialisations: where the weights of a new router come from."""

from ..registry import NoOptions, component_options
from ..target import ATTENTION, MLP, LayerBuild, Target


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

    def __init__(self, recipe, target: Target, dense_config, run=None):
        self.recipe, self.target, self.dense_config, self.run = recipe, target, dense_config, run
        self.options = component_options(type(self), recipe.options)

    def request(self, context) -> None:
        """Ask `context` for the calibration statistics `prepare` and `tensors` will use."""

    def prepare(self, context) -> None:
        """Compute what every layer needs, before the dense model is released."""

    def tensors(self, layer_idx: int, built: LayerBuild, context) -> dict:
        """The router's tensors of one layer, keyed under the router (`weight`, ...), in float32."""
        raise NotImplementedError

    def info(self) -> dict:
        """Extra `conversion_info` entries."""
        return {}

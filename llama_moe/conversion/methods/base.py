"""Base classes of the construction methods: how one dense block of every decoder layer becomes experts.

ConstructionMethod   the interface (request -> prepare -> build per layer -> finish)
SplitMethod          experts are subsets of the dense FFN neurons: subclasses implement `split`
CalibratedSplit      splits computed from calibration data for all layers at once (and split files)
"""

import logging

from ..registry import NoOptions, component_options
from ..target import MLP, LayerBuild, Target

logger = logging.getLogger(__name__)


class ConstructionMethod:
    """How one dense block (`target`: the MLP or the attention) becomes experts. Subclass, set `description`, and
    register with `@METHODS.register(name)`.

    The conversion calls, in order: `request(context)` (ask for calibration statistics), `prepare(context)`
    (compute what all layers need, while the dense model is loaded), `build(layer_idx, dense, context)` for each
    converted layer as the checkpoint streams, then `finish()`.
    """

    name = ""  # set by METHODS.register
    description = ""  # one sentence: the card, `--help` and `info` show it
    target = MLP
    Options = NoOptions
    allows_shared_experts = True
    neuron_split = False  # experts are subsets of the dense neurons (compensation and selectors need this)
    representative_neurons = False  # its splits name a representative neuron per routed expert (analytical routers)
    uses_split_files = False  # --save-split / --load-split apply
    # `llama-moe merge` may split each model's FFN with it: its experts come from the FFN's weights alone (no
    # calibration pass over a model), one router row each, so the gate widens to every model's experts
    mergeable = False
    default_router_init = "random"
    # its construction back-propagates the next-token loss through the dense model (`context.importance`): the
    # calibration runs a pass layer by layer keeping each layer's input, then one back down (the forecast counts it)
    gradient_pass = False

    def __init__(self, recipe, target: Target, dense_config, run=None):
        self.recipe, self.target, self.dense_config, self.run = recipe, target, dense_config, run
        self.options = component_options(type(self), recipe.options)

    def request(self, context) -> None:
        """Ask `context` for the calibration statistics that `prepare` and `build` will use."""

    def prepare(self, context) -> None:
        """Compute what every layer needs, before the dense model is released."""

    def build(self, layer_idx: int, dense: dict, context) -> LayerBuild:
        """The layer's expert tensors (keyed under the block) from its dense tensors."""
        raise NotImplementedError

    def finish(self, context) -> None:
        """Called after the last layer was built."""

    def router_tensors(self, gate: dict) -> dict:
        """The router's tensors as the built experts need them, from what the router init made for the recipe's
        `target.num_experts` experts (fine-grained upcycling repeats each row for the pieces of its expert)."""
        return gate

    def expert_size(self) -> int:
        return self.dense_config.intermediate_size

    @classmethod
    def default_score_scale(cls, num_experts: int, top_k: int) -> float:
        """The expert output scale when the recipe sets none."""
        return 1.0

    def config_fields(self) -> dict:
        """Config fields this method decides (expert sizes)."""
        return {}

    def info(self) -> dict:
        """Extra `conversion_info` entries."""
        return {}

    def card_note(self) -> str:
        """What to expect from the converted model before training (model card)."""
        t = self.target
        return (
            f"Each token uses {t.top_k} of {t.num_experts} experts with a router that was not trained, so quality is "
            "below the dense model until the MoE is trained (LLaMA-MoE recovers it with continual pre-training)."
        )


class SplitMethod(ConstructionMethod):
    """Each expert is a subset of the dense FFN's neurons (`ExpertSplit`); subclasses implement `split`."""

    neuron_split = True

    def split(self, layer_idx: int, dense: dict, context):
        raise NotImplementedError

    def build(self, layer_idx, dense, context) -> LayerBuild:
        from ..experts import build_expert_tensors

        split = self.split(layer_idx, dense, context)
        weights = [dense[f"{name}_proj.weight"] for name in ("gate", "up", "down")]
        return LayerBuild(dense=dense, tensors=build_expert_tensors(*weights, split), split=split)

    def expert_size(self) -> int:
        from ..experts import check_split_sizes

        t = self.target
        return check_split_sizes(self.dense_config.intermediate_size, t.num_experts, t.num_shared_experts)

    @classmethod
    def default_score_scale(cls, num_experts: int, top_k: int) -> float:
        # Top-k of N equal parts of the FFN: rescale by N/k so the output keeps the dense magnitude (LLaMA-MoE).
        return num_experts / top_k

    def config_fields(self) -> dict:
        size = self.expert_size()
        return {"moe_intermediate_size": size, "shared_expert_intermediate_size": size}

    def card_note(self) -> str:
        return super().card_note() + (
            " With top-k equal to the number of experts, a zero router and score scale factor equal to the number of "
            "experts it computes exactly the dense model."
        )


class CalibratedSplit(SplitMethod):
    """Splits computed from calibration data for every layer in `prepare` (or read with --load-split), and saved with
    --save-split after the last layer. Subclasses implement `request_data` and `construct`."""

    uses_split_files = True

    def request(self, context) -> None:
        if self.run is not None and self.run.load_split:
            self._splits = self._load_split_file(context)
        else:
            self._splits = None
            self.request_data(context)

    def request_data(self, context) -> None:
        """Ask for the statistics `construct` uses."""

    def construct(self, context) -> dict:
        """layer -> ExpertSplit for every converted layer."""
        raise NotImplementedError

    def prepare(self, context) -> None:
        if self._splits is None:
            self._splits = self.construct(context)

    def split(self, layer_idx, dense, context):
        return self._splits[layer_idx]

    def finish(self, context) -> None:
        if self.run is not None and self.run.save_split:
            from ..split_files import save_splits

            routers = self.split_file_routers(context)
            save_splits(self.run.save_split, self._splits, routers, metadata={"method": self.name})
            logger.info("Wrote the expert split to %s.", self.run.save_split)

    def split_file_routers(self, context) -> dict | None:
        """Routers saved next to the split (the k-means routers of the residual method)."""
        return None

    def _load_split_file(self, context) -> dict:
        from ..split_files import check_loaded_split, load_splits

        path = self.run.load_split
        splits, routers, metadata = load_splits(path)
        logger.info("Read the expert split from %s (%s).", path, metadata.get("method", "unknown method"))
        missing = [i for i in self.target.layers if i not in splits]
        if missing:
            raise ValueError(f"Split file {path} has no split for MoE layers {missing}.")
        for i in self.target.layers:
            check_loaded_split(
                splits[i], i, self.dense_config.intermediate_size, self.target.num_experts, self.expert_size()
            )
        context.set_kmeans_centroids(routers)
        return splits

    def info(self) -> dict:
        return {"split_file": str(self.run.load_split)} if self.run is not None and self.run.load_split else {}

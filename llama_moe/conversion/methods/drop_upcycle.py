"""Drop-Upcycling (Nakamura et al., ICLR 2025, arXiv 2502.19261).

Every expert starts as a copy of the dense FFN (sparse upcycling); then, per expert, a random share r of the
intermediate neurons (`drop_ratio`, round(r * I) of them, drawn independently for each expert) is re-initialised
("diversity re-initialisation"): those neurons' gate_proj and up_proj rows and down_proj columns are drawn from a
normal distribution with the mean and standard deviation of the dense matrix they replace. Each expert keeps 1 - r of
the dense knowledge and the experts differ from the start, which the paper finds trains to better MoEs over long runs
than plain upcycling (r = 0.5 is its recommendation; r = 1 re-initialises every neuron from the statistics).
"""

import dataclasses

from ..registry import METHODS, option
from ..target import SPLIT_STREAM, layer_seed
from .base import SplitMethod


@dataclasses.dataclass(frozen=True)
class DropUpcycleOptions:
    drop_ratio: float = option(
        0.5,
        "share r of each expert's FFN neurons re-initialised from the dense weights' mean and std (0 < r <= 1)",
    )


@METHODS.register("drop_upcycle")
class DropUpcycle(SplitMethod):
    description = (
        "Drop-Upcycling: every expert a copy of the dense FFN with a random share of its neurons re-initialised "
        "from the dense weights' statistics."
    )
    Options = DropUpcycleOptions
    allows_shared_experts = False
    neuron_split = False  # every expert holds every neuron
    mergeable = True

    def __init__(self, recipe, target, dense_config, run=None):
        super().__init__(recipe, target, dense_config, run)
        if not 0 < self.options.drop_ratio <= 1:
            raise ValueError(f"--drop-ratio must be in (0, 1], got {self.options.drop_ratio}.")

    def split(self, layer_idx, dense, context):
        from ..experts import split_upcycle

        return split_upcycle(self.dense_config.intermediate_size, self.target.num_experts)

    def build(self, layer_idx, dense, context):
        import torch

        built = super().build(layer_idx, dense, context)
        size = self.dense_config.intermediate_size
        dropped = round(self.options.drop_ratio * size)
        gate_up = built.tensors["experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
        down = built.tensors["experts.down_proj"]  # [E, H, I]
        generator = torch.Generator().manual_seed(layer_seed(self.recipe.seed, layer_idx, SPLIT_STREAM))
        draw = {name: _normal_like(dense[f"{name}_proj.weight"], generator) for name in ("gate", "up", "down")}
        for expert in range(self.target.num_experts):
            neurons = torch.randperm(size, generator=generator)[:dropped]
            gate_up[expert, neurons] = draw["gate"]((dropped, gate_up.shape[2]))
            gate_up[expert, size + neurons] = draw["up"]((dropped, gate_up.shape[2]))
            down[expert, :, neurons] = draw["down"]((down.shape[1], dropped))
        return built

    def expert_size(self) -> int:
        return self.dense_config.intermediate_size

    @classmethod
    def default_score_scale(cls, num_experts: int, top_k: int) -> float:
        return 1.0  # the top-k weights sum to 1 and every expert is a full-size FFN

    def card_note(self) -> str:
        return (
            f"Every expert is a copy of the dense FFN with {self.options.drop_ratio:.0%} of its neurons re-initialised "
            "at random (Drop-Upcycling), so unlike plain upcycling the model does not compute what the dense model "
            "computes before training: train it (continual pre-training) to recover and specialise the experts."
        )


def _normal_like(weight, generator):
    """shape -> values drawn from N(mean, std) of `weight` (computed in float32), in `weight`'s dtype."""
    import torch

    values = weight.float()
    mean, std = values.mean().item(), values.std().item()

    def draw(shape):
        return (torch.randn(shape, generator=generator) * std + mean).to(weight.device, weight.dtype)

    return draw

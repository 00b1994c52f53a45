"""`trained`: a router-only Branch-Train-MiX MiX stage inside a merge (arXiv:2403.07816). The router rows start as
`expert_data`'s (each expert model's mean hidden state over its own `data`); once the merged folder is written, the
merge trains the routers alone on the mixture of the expert models' data with the continual pre-training recipe
(`train_routers_only`, `merging/mix.py`, a floor above this one) and replaces the folder's router tensors, every other
tensor left as the merge wrote it."""

from dataclasses import dataclass

from ..registry import ROUTER_INITS, option
from .expert_data import ExpertDataRouter


@dataclass(frozen=True)
class TrainedOptions:
    mix_steps: int = option(30, "router-only training steps of the MiX stage on the experts' data mixture")
    mix_learning_rate: float = option(1e-3, "peak learning rate of the MiX stage (cosine decay, no warm-up)")
    mix_batch_size: int = option(4, "blocks per MiX step")
    mix_seq_len: int = option(256, "tokens per MiX block (at most the model's positions)")


@ROUTER_INITS.register("trained")
class TrainedRouter(ExpertDataRouter):
    description = (
        "expert_data's rows, then a router-only MiX stage (Branch-Train-MiX's trains every weight): the routers alone "
        "trained on the mixture of the expert models' data"
    )
    Options = TrainedOptions
    mix_stage = True  # the merge trains these rows after writing (`merging.mix.train_routers`)

    def info(self) -> dict:
        return super().info() | {"mix_steps": self.options.mix_steps}

"""Fine-grained ("virtual group") upcycling: Megatron-Core's `--moe-upcycling-granularity` (He et al., 2024,
"Upcycling Large Language Models into Mixture of Experts", the recipe of NVIDIA's "Llama 3 meets MoE").

The recipe counts whole copies: `num_experts` E copies of the dense FFN, each cut into G pieces of I/G neurons
(`upcycle_granularity`), `top_k` k copies per token. The model has E*G experts of I/G neurons and routes k*G of them:
expert e*G + g is piece g (neurons g*I/G .. (g+1)*I/G - 1) of copy e, and its router row is copy e's row, repeated.

Why it equals the dense model: SwiGLU is a sum over neurons, so FFN(x) = sum_g FFN_g(x). The G pieces of copy e get
the same logit z_e (identical rows, identical dot products), so when the k-th and (k+1)-th largest copy logits differ
the top-k*G logits are exactly the pieces of the top-k copies S. The top_k gate renormalises over them:
w(e, g) = exp(z_e) / (G * sum_{e' in S} exp(z_e')) = p_e / G, with p_e the weight copy e would get among k of E
copies. The block outputs s * sum_{e in S} (p_e / G) * sum_g FFN_g(x) = (s / G) * FFN(x), since the p_e sum to 1:
the scale s = G gives the dense FFN whatever the router weights. The recipe's score scale is per copy like its
counts (1.0 by default, as for `upcycle`), and the config's `score_scale_factor` is G times it. (Megatron-Core folds
G into the expert weights instead, its cube root on each SwiGLU matrix, which silu makes approximate.) Copies whose
logits tie exactly at the k-th place could be split by the top-k; a random router never ties, and the zero router's
all-equal logits go to the first experts, which are whole copies.
"""

import dataclasses

from ..registry import METHODS, option
from .base import SplitMethod


@dataclasses.dataclass(frozen=True)
class FineGrainedOptions:
    upcycle_granularity: int = option(
        2,
        "pieces G each copy of the dense FFN is cut into: --num-experts E copies make E*G experts of "
        "intermediate_size/G neurons, --top-k k routes k*G of them",
    )


@METHODS.register("fine_grained_upcycle")
class FineGrainedUpcycle(SplitMethod):
    description = (
        "Fine-grained upcycling (Megatron-Core granularity G): E copies of the dense FFN, each cut into G experts of "
        "1/G of its neurons that share the copy's router row; exactly the dense model before training."
    )
    Options = FineGrainedOptions
    allows_shared_experts = False
    neuron_split = False  # the pieces of all copies hold every neuron E times: no partition to compensate or select

    def __init__(self, recipe, target, dense_config, run=None):
        super().__init__(recipe, target, dense_config, run)
        pieces, size = self.options.upcycle_granularity, dense_config.intermediate_size
        if pieces < 1 or size % pieces:
            raise ValueError(
                f"--upcycle-granularity must be a positive divisor of the FFN's {size} neurons, got {pieces}."
            )

    def split(self, layer_idx, dense, context):
        import torch

        from ..experts import ExpertSplit

        size, pieces = self.dense_config.intermediate_size, self.options.upcycle_granularity
        neurons = torch.arange(size).view(pieces, size // pieces)  # row g: piece g
        return ExpertSplit(expert_neurons=neurons.repeat(self.target.num_experts, 1))  # expert e*G + g

    def router_tensors(self, gate: dict) -> dict:
        return {
            name: tensor.repeat_interleave(self.options.upcycle_granularity, dim=0) for name, tensor in gate.items()
        }

    def expert_size(self) -> int:
        return self.dense_config.intermediate_size // self.options.upcycle_granularity

    @classmethod
    def default_score_scale(cls, num_experts: int, top_k: int) -> float:
        return 1.0  # per copy, as for `upcycle`; `config_fields` multiplies it by G for the pieces

    def config_fields(self) -> dict:
        t, pieces = self.target, self.options.upcycle_granularity
        return super().config_fields() | {
            "num_experts": t.num_experts * pieces,
            "num_experts_per_tok": t.top_k * pieces,
            "score_scale_factor": t.score_scale_factor * pieces,
        }

    def card_note(self) -> str:
        t, pieces = self.target, self.options.upcycle_granularity
        return (
            f"The {t.num_experts * pieces} experts are {t.num_experts} copies of the dense FFN, each cut into {pieces} "
            f"pieces that share one router row, and each token uses {t.top_k * pieces} of them ({t.top_k} whole "
            f"copies). With the `top_k` gate and the default score scale (1 per copy, {pieces} in the config) the "
            "model computes exactly what the dense model computes before training, whatever the router does. Train it "
            "(continual pre-training) to let the experts diverge."
        )

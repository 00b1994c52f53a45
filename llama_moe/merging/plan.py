"""A merge, planned: the conversion plan of one model's FFN (the per-model method checked on the base's shape), widened
to every expert model: `num_experts = models x experts_per_model`, the gate over all of them, and the shared expert.

Each MoE layer of the output holds, in order, the experts of expert model 0, then of model 1, ...; expert model i's
experts are what the per-model method (`upcycle`: the whole FFN) makes of model i's FFN, its `residual_scale` on the
down projections and its `noise_scale` (mergekit's: Gaussian noise of that std) on every weight.
"""

import dataclasses

import torch

from llama_moe_hf.modeling.configuration_llama_moe import DEFAULT_ROUTER_TYPE

from ..conversion.plan import ConversionPlan
from ..conversion.recipe import MoERecipe
from ..conversion.registry import METHODS, ROUTER_INITS
from ..conversion.target import MLP, SPLIT_STREAM, LayerBuild, layer_seed

EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


def per_model_recipe(merge) -> MoERecipe:
    """The conversion recipe of one expert model's FFN: the method and its experts, the gate init (resolved here so
    that its options are checked), the score scale that makes one model's experts its FFN again."""
    method = METHODS[merge.method]
    scale = merge.score_scale_factor
    if scale is None:
        scale = float(merge.experts_per_model) if method.neuron_split else 1.0
    return MoERecipe(
        family="llama_moe",
        method=merge.method,
        num_experts=merge.experts_per_model,
        top_k=min(merge.experts_per_token, merge.experts_per_model),
        router_type=DEFAULT_ROUTER_TYPE,
        router_init=merge.gate_mode,
        score_scale_factor=scale,
        seed=merge.seed,
        options=dict(merge.gate_options),
    )


@dataclasses.dataclass
class MergePlan(ConversionPlan):
    """`ConversionPlan` whose MLP blocks take their experts from every expert model (`MergedSource`)."""

    merge: object = None  # the MergeConfig
    source: object = None  # the MergedSource

    @classmethod
    def for_merge(cls, merge, source, run) -> "MergePlan":
        if not _mergeable(METHODS[merge.method]):
            usable = [name for name, m in METHODS.items() if _mergeable(m)]
            raise ValueError(
                f"A merge splits each model's FFN with a method that needs no calibration and keeps the router's "
                f"rows ({', '.join(usable)}), not {merge.method!r}."
            )
        plan = cls.create(per_model_recipe(merge), source.config, run)
        plan.merge, plan.source = merge, source
        plan._widen()
        return plan

    def _widen(self) -> None:
        """The MLP target and its gate over every expert model; the shared expert's neurons as one FFN's."""
        one = self.targets[MLP]
        method, _ = self.components[MLP]
        shared = self.dense_config.intermediate_size // method.expert_size() if self.merge.shared_experts else 0
        total = dataclasses.replace(
            one, num_experts=self.merge.num_experts, top_k=self.merge.experts_per_token, num_shared_experts=shared
        )
        self.targets[MLP] = total
        self.recipe = dataclasses.replace(
            self.recipe, num_experts=total.num_experts, top_k=total.top_k, num_shared_experts=shared
        )
        router = ROUTER_INITS[total.router_init](self.recipe, total, self.dense_config, self.run)
        self.components[MLP] = (method, router)
        self.build_output()

    def _block_tensors(self, kind: str, layer_idx: int, dense: dict, context) -> dict:
        if kind != MLP:
            return super()._block_tensors(kind, layer_idx, dense, context)
        method, router = self.components[MLP]
        pieces = []
        for index, (model, expert) in enumerate(zip(self.source.experts, self.merge.experts, strict=True)):
            ffn = self._scaled(self.source.ffn(model, layer_idx), expert, layer_idx, index)
            pieces.append(method.build(layer_idx, ffn, context).tensors)
        tensors = {name: torch.cat([piece[name] for piece in pieces]) for name in EXPERT_TENSORS}
        if self.merge.shared_experts:
            expert = self.merge.shared_experts[0]
            ffn = self._scaled(self.source.ffn(self.source.shared[0], layer_idx), expert, layer_idx, len(pieces))
            tensors.update({f"shared_experts.{name}": tensor.contiguous() for name, tensor in ffn.items()})
        gate = router.tensors(layer_idx, LayerBuild(dense=dense, tensors=tensors), context)
        return tensors | {f"gate.{name}": tensor for name, tensor in gate.items()}

    def _scaled(self, ffn: dict, expert, layer_idx: int, index: int) -> dict:
        """One model's FFN with its expert settings applied: residual_scale on down_proj, then noise_scale."""
        ffn = dict(ffn)
        if expert.residual_scale != 1.0:
            ffn["down_proj.weight"] = ffn["down_proj.weight"] * expert.residual_scale
        if expert.noise_scale:
            generator = torch.Generator().manual_seed(layer_seed(self.merge.seed, layer_idx, SPLIT_STREAM) + index)
            for name, tensor in ffn.items():
                noise = torch.randn(tensor.shape, generator=generator) * expert.noise_scale
                ffn[name] = (tensor.float() + noise).to(tensor.dtype)
        return ffn


def _mergeable(method) -> bool:
    """Methods whose experts come from the FFN's weights alone (no calibration pass over a model), one router row
    per expert (fine-grained upcycling's repeated rows and its own expert counts would not widen)."""
    from ..conversion.methods.base import ConstructionMethod

    own = (method.request, method.prepare, method.router_tensors)
    plain = (ConstructionMethod.request, ConstructionMethod.prepare, ConstructionMethod.router_tensors)
    return method.target == MLP and own == plain

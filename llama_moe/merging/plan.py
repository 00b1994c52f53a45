"""A merge, planned in one step: one model's FFN split as a conversion would split it (the per-model method checked on
the base's shape), the gate over every expert model's experts (`num_experts = models x experts_per_model`), and the
shared expert.

Each MoE layer of the output holds, in order, the experts of expert model 0, then of model 1, ...; expert model i's
experts are what the per-model method (`upcycle`: the whole FFN) makes of model i's FFN, its `residual_scale` on the
down projections and its `noise_scale` (mergekit's: Gaussian noise of that std) on every weight.
"""

import dataclasses

import torch

from llama_moe_hf.modeling.configuration_llama_moe import DEFAULT_ROUTER_TYPE

from ..conversion.plan import ConversionPlan, plan_target, resolve_for_model, resolve_recipe
from ..conversion.recipe import MoERecipe
from ..conversion.registry import FAMILIES, METHODS, ROUTER_INITS
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
        """One model's FFN split as a conversion would split it (its recipe checked as one), the MLP target and its
        gate over every expert model's experts, the shared expert's neurons as one FFN's; the output built once."""
        if not METHODS[merge.method].mergeable:
            usable = [name for name, method in METHODS.items() if method.mergeable]
            raise ValueError(
                f"A merge splits each model's FFN with a method that needs no calibration and keeps the router's "
                f"rows ({', '.join(usable)}), not {merge.method!r}."
            )
        dense_config = source.config
        recipe = resolve_for_model(resolve_recipe(per_model_recipe(merge), run=run), dense_config)
        family = FAMILIES[recipe.family]()
        one = plan_target(recipe, family, MLP, dense_config)
        method = METHODS[one.method](recipe, one, dense_config, run)  # builds one model's experts
        shared = dense_config.intermediate_size // method.expert_size() if merge.shared_experts else 0
        counts = {"num_experts": merge.num_experts, "top_k": merge.experts_per_token, "num_shared_experts": shared}
        total, recipe = dataclasses.replace(one, **counts), dataclasses.replace(recipe, **counts)
        router = ROUTER_INITS[total.router_init](recipe, total, dense_config, run)
        plan = cls(recipe, run, family, dense_config, {MLP: total}, {MLP: (method, router)}, merge=merge, source=source)
        plan.build_output()
        return plan

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

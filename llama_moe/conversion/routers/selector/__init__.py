"""G-MoEfication's expert selector (MoEfication's router network), trained on calibration data."""

from dataclasses import dataclass

from ...registry import ROUTER_INITS, option
from ...target import MLP, SELECTOR_STREAM, layer_seed
from ..base import RouterInit

SELECTOR_OBJECTIVES = ("listwise", "bce")  # the selector router's training loss


@dataclass(frozen=True)
class SelectorOptions:
    selector_steps: int = option(100, "L-BFGS iterations per layer of the selector's training")
    selector_objective: str = option(
        "listwise",
        "the selector's loss: listwise ranking (ranks better on SmolLM2, benchmarks/reports/gmoefication.md) or "
        "MoEfication's bce",
        choices=SELECTOR_OBJECTIVES,
    )


@ROUTER_INITS.register("selector")
class SelectorRouter(RouterInit):
    description = (
        "MoEfication's expert selector trained on calibration data to rank the experts by the output a token would "
        "lose without them (G-MoEfication; unit expert weights)"
    )
    Options = SelectorOptions
    targets = (MLP,)
    router_type = "selector"
    needs_neuron_split = True
    unit_weights = True
    fitted_router_type = "selector"  # the router module `fit` trains

    def request(self, context) -> None:
        context.request_mlp(self.target.layers)
        self._quality = []  # per layer: held-out energy recall of the selector and of a random router

    def tensors(self, layer_idx, built, context) -> dict:
        state, quality = self.fit(layer_idx, built, context)
        self._quality.append(quality)
        return state

    def fit(self, layer_idx, built, context) -> tuple[dict, dict]:
        """One layer's fitted router state and its held-out quality (`gmoefication.train_layer_selector`)."""
        from .gmoefication import train_layer_selector

        stats = context.mlp(layer_idx)
        mean = stats.mean_activation[built.split.expert_neurons] if self.recipe.compensation else None
        steps, objective = self.fit_settings()
        return train_layer_selector(
            stats.hidden_states,
            built.tensors,
            mean,
            top_k=self.target.top_k,
            steps=steps,
            objective=objective,
            seed=layer_seed(self.recipe.seed, layer_idx, SELECTOR_STREAM),
            router_type=self.fitted_router_type,
        )

    def fit_settings(self) -> tuple[int, str]:
        """(L-BFGS steps, objective) of the fit."""
        return self.options.selector_steps, self.options.selector_objective

    def info(self) -> dict:
        """The mean over layers of the selectors' held-out energy recall at top-k, next to a random router's."""
        if not self._quality:
            return {}
        return {key: round(sum(q[key] for q in self._quality) / len(self._quality), 4) for key in self._quality[0]}

"""G-MoEfication: training-free MoE conversion of SwiGLU (non-ReLU) FFNs.

A SwiGLU FFN is a sum over neurons, `down[:, j] * a_j(x)` with `a_j(x) = silu(gate_j . x) * (up_j . x)`. An expert that
a token does not use still has nonzero activations, so dropping it loses `sum_{j in e} down[:, j] * a_j(x)`.
G-MoEfication replaces the dropped activations by their means over calibration data, `mu_j`, which costs one stored
vector per expert, `m_e = down_e @ mu_e` (the `[E, H]` compensation table). What is lost then is the *deviation*
`(a_e(x) - mu_e) @ down_e^T`; its energy per expert is what a good router should rank (the oracle below does so
exactly) and what the expert selector (MoEfication's small router network) is trained to predict.

All functions take the fused expert tensors of `build_expert_tensors` (`gate_up_proj [E, 2m, H]`,
`down_proj [E, H, m]`) and the per-expert means `expert_mean [E, m]` = `mean_activation[split.expert_neurons]`.
"""

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llama_moe_hf.modeling.configuration_llama_moe import LlamaMoEConfig
from llama_moe_hf.modeling.routers import ROUTER_CLASSES

from ...experts import ExpertSplit
from . import SELECTOR_OBJECTIVES

logger = logging.getLogger(__name__)
ENERGY_CHUNK_TOKENS = 2048


def compensation_table(split: ExpertSplit, down_proj: torch.Tensor, mean_activation: torch.Tensor) -> torch.Tensor:
    """`[E, H]`: row e = `down_proj[:, neurons_e] @ mean_activation[neurons_e]`, expert e's output at its mean."""
    index = split.expert_neurons  # [E, m]
    down = down_proj.float()[:, index]  # [H, E, m]
    return torch.einsum("hem,em->eh", down, mean_activation.float()[index]).to(down_proj.dtype)


def deviation_energy(
    hidden_states: torch.Tensor,  # [T, H]
    gate_up_proj: torch.Tensor,  # [E, 2m, H]
    down_proj: torch.Tensor,  # [E, H, m]
    expert_mean: torch.Tensor,  # [E, m]
    output_offset: torch.Tensor | None = None,  # [E, H]
) -> torch.Tensor:
    """`[T, E]`: squared norm of `(a_e(x) - mu_e) @ down_e^T - c_e`, the output error of replacing expert e by its
    mean (`c_e`: `output_offset`, 0 when None).

    Pass `expert_mean = 0` for the error of dropping an expert without compensation, and `output_offset` for a
    compensation row that is not `down_e mu_e` (trained, as healing trains it). Computed in float32, in chunks
    of tokens so that the `[t, E, m]` intermediates stay small for long calibration samples. Where it saves work the
    squared norm is `d^T (down_e^T down_e) d - 2 d . down_e^T c_e + |c_e|^2` with the `[E, m, m]` Gram matrices: m x m
    instead of H x m multiply-adds per token and expert (a third of them on SmolLM2 with 8 experts, whose m = 192
    against H = 576), for H x m x m once; on few tokens of a wide model (healing's batches of Llama-3-8B's layers,
    m = 1792, H = 4096) the Gram matrices cost more than they save and the output error is projected directly.
    """
    gate_up_proj, down_proj = gate_up_proj.float(), down_proj.float()
    expert_mean = expert_mean.to(gate_up_proj.device, torch.float32)
    offset = torch.zeros_like(down_proj[:, :, 0]) if output_offset is None else output_offset.float()  # [E, H]
    hidden, inner = down_proj.shape[1:]
    if not _gram_saves(hidden_states.shape[0], hidden, inner):
        return _direct_energy(hidden_states, gate_up_proj, down_proj, expert_mean, offset)
    gram = down_proj.transpose(1, 2) @ down_proj  # [E, m, m]
    offset_in, offset_norm = torch.einsum("ehm,eh->em", down_proj, offset), offset.pow(2).sum(-1)  # [E, m], [E]
    energies = []
    for chunk in hidden_states.split(ENERGY_CHUNK_TOKENS):
        deviation = _deviation(chunk, gate_up_proj, expert_mean)  # [t, E, m]
        projected = torch.einsum("tem,emn->ten", deviation, gram) - 2 * offset_in
        energies.append(((projected * deviation).sum(-1) + offset_norm).clamp_min(0))  # >= 0 but for rounding
    return torch.cat(energies)


def energy_flops(tokens: int, hidden: int, inner: int, experts: int) -> float:
    """The FLOPs of `deviation_energy` on `tokens` rows (`experts` experts of `inner` neurons, `hidden` wide): the
    activations, then the Gram form or the direct projection, whichever it takes."""
    if not tokens:
        return 0.0
    output = inner * inner * (hidden + tokens) if _gram_saves(tokens, hidden, inner) else tokens * hidden * inner
    return 2.0 * experts * (2 * inner * hidden * tokens + output)


def _gram_saves(tokens: int, hidden: int, inner: int) -> bool:
    """Whether the Gram form's multiply-adds per expert, `H m^2 + T m^2`, are fewer than the direct `T H m`."""
    return inner * (hidden + tokens) < tokens * hidden


def _deviation(chunk: torch.Tensor, gate_up_proj: torch.Tensor, expert_mean: torch.Tensor) -> torch.Tensor:
    """`[t, E, m]`: each expert's activations on the tokens `chunk [t, H]` less their means."""
    gate, up = torch.einsum("th,efh->tef", chunk.float(), gate_up_proj).chunk(2, dim=-1)
    return F.silu(gate) * up - expert_mean


def _direct_energy(hidden_states, gate_up_proj, down_proj, expert_mean, offset) -> torch.Tensor:
    """`deviation_energy` as the squared norm of each expert's projected output error, `[t, E, H]` a chunk."""
    energies = []
    for chunk in hidden_states.split(ENERGY_CHUNK_TOKENS // 4):  # [t, E, H] is H / m times the Gram form's
        error = torch.einsum("tem,ehm->teh", _deviation(chunk, gate_up_proj, expert_mean), down_proj) - offset
        energies.append(error.pow(2).sum(-1))
    return torch.cat(energies)


def oracle_top_k(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    expert_mean: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """`[T, k]` experts with the largest deviation energy: the routing no real router can beat (a reference only)."""
    return deviation_energy(hidden_states, gate_up_proj, down_proj, expert_mean).topk(top_k, dim=-1).indices


@contextlib.contextmanager
def oracle_routing(model, expert_means: dict[int, torch.Tensor]):
    """Within the context, every MoE layer of `model` routes with `oracle_top_k` and unit weights (evaluation only).

    `expert_means[layer]` is that layer's `[E, m]` mean activation (zeros: the oracle for no compensation). Forward
    hooks replace each router's `(logits, weights, index)`, so the block's experts and compensation use the oracle's
    choice.
    """

    def hook(router, args, output, layer_idx):
        experts = model.model.layers[layer_idx].mlp.experts
        index = oracle_top_k(args[0], experts.gate_up_proj, experts.down_proj, expert_means[layer_idx], router.top_k)
        return output[0], torch.ones(index.shape, dtype=output[1].dtype, device=index.device), index

    handles = [
        model.model.layers[layer_idx].mlp.gate.register_forward_hook(
            lambda router, args, output, layer_idx=layer_idx: hook(router, args, output, layer_idx)
        )
        for layer_idx in expert_means
    ]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def check_selector_objective(objective: str) -> None:
    if objective not in SELECTOR_OBJECTIVES:
        raise ValueError(
            f"Unknown selector objective {objective!r}; --selector-objective must be one of "
            f"{', '.join(SELECTOR_OBJECTIVES)}."
        )


def selector_loss(scores: torch.Tensor, energy: torch.Tensor, objective: str = "listwise") -> torch.Tensor:
    """Loss of the selector's `scores [T, E]` against the `deviation_energy [T, E]`.

    `"listwise"` (default): listwise cross-entropy (ListNet). Only the ranking of the scores matters to a top-k
    router, so they are fit to the log energies up to a per-token constant, from both ends: `softmax(scores)` to the
    energy shares (which experts to keep, what top-2 needs) and `softmax(-scores)` to the inverse-energy shares (which
    experts to drop, what top-6 of 8 needs). On SmolLM2 this ranks better at every k than `"bce"`
    (benchmarks/reports/gmoefication.md).
    `"bce"`: MoEfication's objective, binary cross-entropy of `sigmoid(scores)` against each expert's energy divided
    by the token's largest.
    """
    return selector_objective(energy, objective)(scores)


def selector_objective(energy: torch.Tensor, objective: str = "listwise") -> Callable[[torch.Tensor], torch.Tensor]:
    """`scores -> selector_loss(scores, energy, objective)` with the targets computed once from `energy`, for the
    training, which evaluates the loss about a hundred times on the same energies."""
    check_selector_objective(objective)
    tiny = torch.finfo(energy.dtype).tiny
    if objective == "bce":
        target = energy / energy.amax(-1, keepdim=True).clamp_min(tiny)
        return lambda scores: F.binary_cross_entropy_with_logits(scores, target)
    log_energy = energy.clamp_min(tiny).log()
    # Cross-entropy against shares p that sum to 1: -(p * log_softmax(s)).sum(-1) = logsumexp(s) - (p * s).sum(-1),
    # so both ends together are two logsumexps and one linear term (no [T, E] softmax per evaluation).
    shares = F.softmax(log_energy, -1) - F.softmax(-log_energy, -1)

    def listwise(scores: torch.Tensor) -> torch.Tensor:
        linear = (shares * scores).sum() / scores.shape[0]
        return (torch.logsumexp(scores, -1) + torch.logsumexp(-scores, -1)).mean() - linear

    return listwise


def _ranking_router(hidden_size: int, num_experts: int, router_type: str = "selector"):
    """The model's own router module of `router_type` (`"selector"`: MoEfication's network; `"top_k"`: a linear
    softmax router), so the trained state dict loads into `mlp.gate` as is."""
    config = LlamaMoEConfig(
        vocab_size=1,
        bos_token_id=None,
        eos_token_id=None,
        hidden_size=hidden_size,
        intermediate_size=num_experts,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        num_experts=num_experts,
        num_experts_per_tok=1,
        router_type=router_type,
    )
    router = ROUTER_CLASSES[router_type](config)
    bound = hidden_size**-0.5  # nn.Linear's default init for the first layer; the selector's second is an nn.Linear
    for name in ("weight", "bias"):
        if hasattr(router, name):
            torch.nn.init.uniform_(getattr(router, name), -bound, bound)
    return router


def selector_scores(
    state_dict: dict[str, torch.Tensor], hidden_states: torch.Tensor, router_type: str = "selector"
) -> torch.Tensor:
    """`[T, E]` scores (logits) of a trained selector (or linear router) state dict."""
    num_experts, hidden_size = state_dict["weight"].shape
    router = _ranking_router(hidden_size, num_experts, router_type)
    router.load_state_dict(state_dict)
    with torch.no_grad():
        return router(hidden_states)[0]


def train_selector(
    hidden_states: torch.Tensor,  # [T, H]
    energy: torch.Tensor,  # [T, E]
    num_experts: int,
    steps: int = 100,
    seed: int = 0,
    objective: str = "listwise",
    router_type: str = "selector",
) -> dict[str, torch.Tensor]:
    """Fit MoEfication's selector `Linear(H, E) -> tanh -> Linear(E, E)` (or, `router_type="top_k"`, the linear
    logits every export target computes) to rank the experts by `energy`.

    Full-batch L-BFGS (`steps` iterations, strong-Wolfe line search) on `selector_loss(..., objective)`: the network
    is tiny and the batch fits in memory, so it converges in ~100 iterations where Adam needs ~1000 and diverges at
    high learning rates. Deterministic for a given seed. Returns the router's state dict (`weight`, `bias`,
    `selector.weight`, `selector.bias`), to be loaded as `mlp.gate` of a `router_type="selector"` layer.
    """
    check_selector_objective(objective)
    if energy.shape != (hidden_states.shape[0], num_experts):
        raise ValueError(
            f"Selector energies must be [tokens, num_experts] = [{hidden_states.shape[0]}, {num_experts}], "
            f"got {list(energy.shape)}."
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        router = _ranking_router(hidden_states.shape[1], num_experts, router_type)
    hidden_states = hidden_states.detach().float().cpu()
    loss = selector_objective(energy.detach().float().cpu(), objective)
    if steps > 0:
        optimizer = torch.optim.LBFGS(
            router.parameters(), lr=1, max_iter=steps, history_size=20, line_search_fn="strong_wolfe"
        )

        def closure():
            optimizer.zero_grad(set_to_none=True)
            value = loss(router.logits(hidden_states))  # the scores only: the routing weights are not trained here
            value.backward()
            return value

        optimizer.step(closure)
    return {name: tensor.detach().clone() for name, tensor in router.state_dict().items()}


def energy_recall(scores: torch.Tensor, energy: torch.Tensor, top_k: int) -> float:
    """Deviation energy the top-k of `scores` covers, as a fraction of what the oracle's top-k covers (1 = oracle)."""
    chosen = energy.gather(1, scores.topk(top_k, dim=-1).indices).sum()
    return (chosen / energy.topk(top_k, dim=-1).values.sum()).item()


def train_layer_selector(
    hidden_states: torch.Tensor,  # [n, H] calibration MLP inputs
    expert_tensors: dict[str, torch.Tensor],  # `experts.gate_up_proj` [E, 2m, H], `experts.down_proj` [E, H, m]
    expert_mean: torch.Tensor | None,  # [E, m] mean activations (with compensation), or None (without)
    *,
    top_k: int,
    steps: int = 100,
    objective: str = "listwise",
    seed: int = 0,
    holdout: float = 0.1,
    router_type: str = "selector",
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One layer's selector router (state dict keyed under `mlp.gate.`; `router_type="top_k"`: a linear router
    fitted the same way), and its held-out quality.

    The target is each expert's deviation energy: with compensation, the output lost when the expert's activations
    are replaced by their means; without, its whole output. The selector is trained on the first `1 - holdout` of
    the calibration tokens; its `energy_recall` at `top_k` on the rest is returned (and logged) next to a random
    router's (`{"selector_recall", "random_recall"}`, empty without a holdout), so that a bad fit shows.
    """
    gate_up_proj, down_proj = expert_tensors["experts.gate_up_proj"], expert_tensors["experts.down_proj"]
    num_experts = gate_up_proj.shape[0]
    if expert_mean is None:
        expert_mean = torch.zeros(num_experts, down_proj.shape[-1])
    energy = deviation_energy(hidden_states, gate_up_proj, down_proj, expert_mean)
    num_train = max(1, round(hidden_states.shape[0] * (1 - holdout)))
    state = train_selector(
        hidden_states[:num_train], energy[:num_train], num_experts, steps, seed, objective, router_type
    )
    if num_train == hidden_states.shape[0]:
        return state, {}
    held_out = hidden_states[num_train:]
    random_scores = torch.rand(held_out.shape[0], num_experts, generator=torch.Generator().manual_seed(seed))
    quality = {
        "selector_recall": energy_recall(selector_scores(state, held_out, router_type), energy[num_train:], top_k),
        "random_recall": energy_recall(random_scores, energy[num_train:], top_k),
    }
    logger.info(
        "selector energy recall at top-%d on %d held-out tokens: %.3f (random router %.3f)",
        top_k,
        held_out.shape[0],
        quality["selector_recall"],
        quality["random_recall"],
    )
    return state, quality

"""Attention experts (AttnMoE, LLaMA-MoE v2): dense LLaMA attention -> attention-head experts plus a router.

An AttnMoE layer keeps the dense tensors under their names (`self_attn.{q,k,v,o}_proj.*`): the experts are slices
of the heads, fixed by the config, so conversion copies the attention tensors and adds the router
`self_attn.gate.weight` `[E, H]`. The router can start

    "zero"    all logits equal: every expert gets the same weight, and top-k (k < E) ties pick the first k experts;
              only sensible when k == E (exactly the dense attention with scale factor E) or before training
    "random"  normal(0, std), the usual initialisation before training
    "fit"     training-free: a ridge regression from the attention input to each expert's output norm on
              calibration text, so the router prefers the experts that contribute most (`fit_attention_routers`)
"""

import torch
from tqdm.auto import tqdm

from ..modeling.configuration_attn_moe import AttnMoEConfig
from ..modeling.modeling_attn_moe import AttnMoEForCausalLM
from .convert import ModelFamily, dense_config_fields, layer_seed

ATTENTION_ROUTER_INITS = ("zero", "random", "fit")
_ATTENTION_KEYS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


def attn_moe_config(dense_config, **fields) -> AttnMoEConfig:
    """AttnMoEConfig from a dense LLaMA-family config plus the AttnMoE (and optionally LlamaMoE MLP) fields.

    Raises the config's ValueError for impossible head groupings or top-k.
    """
    return AttnMoEConfig(**{**dense_config_fields(dense_config), **fields})


def init_attention_router(
    num_experts: int, hidden_size: int, init: str = "random", *, std: float = 0.02, seed: int = 0
) -> torch.Tensor:
    """Router weight `[E, H]` (float32) for the "zero" and "random" inits ("fit" needs data: fit_attention_routers)."""
    if init == "zero":
        return torch.zeros(num_experts, hidden_size)
    if init == "random":
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(num_experts, hidden_size, generator=generator) * std
    raise ValueError(f"Unknown attention router init {init!r}; choose one of zero, random (fit needs calibration).")


def build_attention_tensors(self_attn: dict[str, torch.Tensor], router_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A dense layer's `self_attn.*` tensors (keys relative to `self_attn.`) -> the AttnMoE layer's tensors.

    The projections are kept as they are (biases too); the router is added as `gate.weight`.
    """
    missing = [key for key in _ATTENTION_KEYS if key not in self_attn]
    if missing:
        raise ValueError(f"The dense attention lacks {missing}; expected LLaMA-style q/k/v/o projections.")
    hidden_size = self_attn["q_proj.weight"].shape[1]
    if router_weight.ndim != 2 or router_weight.shape[1] != hidden_size:
        raise ValueError(f"Router weight must be [num_experts, {hidden_size}], got {tuple(router_weight.shape)}.")
    return {**self_attn, "gate.weight": router_weight.to(self_attn["q_proj.weight"].dtype)}


def expert_output_norms(
    head_outputs: torch.Tensor,  # [N, heads * head_dim], the input of o_proj
    o_proj_weight: torch.Tensor,  # [H, heads * head_dim]
    num_experts: int,
) -> torch.Tensor:
    """`[N, E]`: L2 norm of each expert's contribution to the attention output, ||o_proj[:, heads_e] @ heads_e(x)||."""
    num_tokens = head_outputs.shape[0]
    per_expert = head_outputs.float().view(num_tokens, num_experts, -1)  # [N, E, n*D]
    weight = o_proj_weight.float().view(o_proj_weight.shape[0], num_experts, -1)  # [H, E, n*D]
    return torch.einsum("ned,hed->neh", per_expert, weight).norm(dim=-1)


@torch.no_grad()
def fit_attention_routers(
    model,
    input_ids: torch.LongTensor,  # [B, S] calibration tokens
    num_experts: int,
    *,
    layers: list[int] | None = None,
    batch_size: int = 4,
    ridge: float = 1e-2,
    logit_std: float = 0.1,
    progress: bool = True,
) -> dict[int, torch.Tensor]:
    """Training-free attention routers: per layer, `W [E, H]` such that `x W^T` predicts each expert's output norm.

    One pass of the dense LLaMA-family `model` over `input_ids` records, per layer, the attention input `x`
    (after input_layernorm) and the expert output norms (`expert_output_norms`), centred per token; the normal
    equations are accumulated, so memory does not grow with the number of tokens. The ranking of the logits is
    what selects experts; the fitted weights are then scaled so the logits have standard deviation `logit_std`,
    which keeps the top-k weights close to uniform (with `attention_score_scale_factor = k` the kept experts get
    weight about 1, as in the dense model).
    """
    decoder_layers = model.model.layers
    layers = list(range(len(decoder_layers))) if layers is None else layers
    hidden_size = model.config.hidden_size
    gram = {i: torch.zeros(hidden_size, hidden_size, dtype=torch.float64) for i in layers}
    cross = {i: torch.zeros(hidden_size, num_experts, dtype=torch.float64) for i in layers}
    inputs: dict[int, torch.Tensor] = {}

    def save_input(layer_idx):
        def hook(module, args, kwargs):
            inputs[layer_idx] = kwargs.get("hidden_states", args[0] if args else None)

        return hook

    def accumulate(layer_idx):
        def hook(module, args):
            x = inputs.pop(layer_idx).reshape(-1, hidden_size).double()  # [N, H]
            norms = expert_output_norms(args[0].reshape(x.shape[0], -1), module.weight, num_experts).double()
            target = norms - norms.mean(dim=1, keepdim=True)  # only the ranking within a token matters
            gram[layer_idx] += x.T @ x
            cross[layer_idx] += x.T @ target

        return hook

    handles = []
    for i in layers:
        attention = decoder_layers[i].self_attn
        handles.append(attention.register_forward_pre_hook(save_input(i), with_kwargs=True))
        handles.append(attention.o_proj.register_forward_pre_hook(accumulate(i)))
    try:
        batches = range(0, input_ids.shape[0], batch_size)
        for start in tqdm(batches, desc="Fitting attention routers", unit="batch", disable=not progress):
            model(input_ids=input_ids[start : start + batch_size].to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    routers = {}
    for i in layers:
        scale = ridge * gram[i].diagonal().mean()
        solution = torch.linalg.solve(gram[i] + scale * torch.eye(hidden_size, dtype=torch.float64), cross[i])
        weight = solution.T  # [E, H]
        # Logit spread on the calibration data: sqrt(mean of w_e^T (X^T X / N) w_e) over experts.
        count = input_ids.numel()
        spread = torch.sqrt(torch.einsum("eh,hk,ek->", weight, gram[i] / count, weight) / num_experts)
        routers[i] = (weight * (logit_std / spread.clamp_min(1e-12))).float()
    return routers


def attn_moe_from_dense(
    dense_model,
    *,
    router_init: str = "random",
    routers: dict[int, torch.Tensor] | None = None,
    mlp_splits: dict | None = None,
    seed: int = 0,
    **fields,
):
    """An AttnMoEForCausalLM built in memory from a dense LLaMA-family causal LM (small models, tests, measurements).

    `fields` are AttnMoEConfig fields (`num_attention_experts`, ...; `moe_layers` etc. for an MLP MoE, whose layers
    then need an `ExpertSplit` in `mlp_splits[layer_idx]`). Routers come from `routers[layer_idx]` when given
    (e.g. `fit_attention_routers`), else from `init_attention_router(router_init)`. The streaming converter
    (`llama-moe convert`) writes the same tensors to disk without holding the model.
    """
    from .experts import build_expert_tensors

    config = attn_moe_config(dense_model.config, **fields)
    state = dict(dense_model.state_dict())
    for i in config.attention_moe_layers:
        prefix = f"model.layers.{i}.self_attn."
        dense_attention = {key[len(prefix) :]: state.pop(key) for key in list(state) if key.startswith(prefix)}
        if routers is not None:
            router = routers[i]
        else:
            router = init_attention_router(
                config.num_attention_experts, config.hidden_size, router_init, std=config.initializer_range,
                seed=seed + i,
            )
        state.update({prefix + key: value for key, value in build_attention_tensors(dense_attention, router).items()})
    for i in config.moe_layers:
        prefix = f"model.layers.{i}.mlp."
        dense_mlp = [state.pop(f"{prefix}{name}_proj.weight") for name in ("gate", "up", "down")]
        state.update({prefix + k: v for k, v in build_expert_tensors(*dense_mlp, mlp_splits[i]).items()})
        state[prefix + "gate.weight"] = init_attention_router(  # same inits for the MLP router
            config.num_experts, config.hidden_size, "random" if router_init == "fit" else router_init,
            std=config.initializer_range, seed=seed + 1000 + i,
        )
    model = AttnMoEForCausalLM(config).to(dense_model.dtype)
    model.load_state_dict(state, strict=not config.tie_word_embeddings)
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------
# Streaming converter (`llama-moe convert --attn-experts E --attn-top-k K`): the AttnMoE model family
# ---------------------------------------------------------------------------------------------------------------

# Options that only shape an MLP MoE, and the conversion record entries that describe it.
_MLP_OPTIONS = ("method", "num_experts", "top_k", "num_shared_experts", "score_scale_factor", "moe_layers")
_MLP_INFO = ("method", "num_experts", "top_k", "num_shared_experts", "router_init", "score_scale_factor")


class AttnMoEFamily(ModelFamily):
    """Dense LLaMA -> AttnMoE: attention tensors are copied, a router is added per layer; the MLPs stay dense unless
    `mlp_moe` is set, in which case the MLP options build a LlamaMoE MLP MoE as usual."""

    config_class = AttnMoEConfig
    model_class = AttnMoEForCausalLM

    def __init__(self, options, source):
        super().__init__(options, source)
        defaults = type(options)()
        changed = [name for name in _MLP_OPTIONS if getattr(options, name) != getattr(defaults, name)]
        if not options.mlp_moe and changed:
            flags = ", ".join("--" + name.replace("_", "-") for name in changed)
            raise ValueError(f"{flags} shape an MLP MoE; add --mlp-moe to convert the MLPs as well as the attention.")
        if options.router_type == "selector":
            raise ValueError("--router-type selector is not available for attention experts; use top_k or switch.")
        self.router_init = options.attn_router_init or (
            options.router_init if options.router_init in ("zero", "random") else "random"
        )
        if self.router_init not in ATTENTION_ROUTER_INITS:
            raise ValueError(
                f"Unknown --attn-router-init {self.router_init!r}; choose one of {', '.join(ATTENTION_ROUTER_INITS)}."
            )
        self._fitted = None

    def build_config(self, moe_fields: dict):
        o = self.options
        fields = dict(moe_fields)
        info = dict(fields.pop("conversion_info", None) or {})
        if not o.mlp_moe:
            fields["moe_layers"] = []
            info = {k: v for k, v in info.items() if k not in _MLP_INFO}
        elif fields.get("moe_layers") is None:  # LlamaMoE's "every layer" (AttnMoEConfig's None means none)
            fields["moe_layers"] = list(range(self.source.config.num_hidden_layers))
        attention = {
            "num_attention_experts": o.attn_experts,
            "num_attention_experts_per_tok": o.attn_top_k,
            "attention_expert_granularity": o.attn_granularity,
            "attention_router_type": o.router_type,
        }
        config = super().build_config({**fields, **attention})
        # Default scale k: with a near-uniform router the k kept experts get weight ~1, as in the dense model.
        scale = o.attn_score_scale_factor
        config.attention_score_scale_factor = float(config.num_attention_experts_per_tok if scale is None else scale)
        config.conversion_info = {
            **info,
            "attention_experts": config.num_attention_experts,
            "attention_top_k": config.num_attention_experts_per_tok,
            "attention_expert_granularity": config.attention_expert_granularity,
            "attention_score_scale_factor": config.attention_score_scale_factor,
            "attention_router_init": self.router_init,
        }
        self.config = config
        return config

    def prepare(self) -> None:
        if self.router_init == "fit":
            self._fit_routers()
        self._dense_model = None

    def transform_attention(self, layer_idx: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        config = self.config
        if layer_idx not in config.attention_moe_layers:
            return tensors
        if self.router_init == "fit":
            router = self._fit_routers()[layer_idx]
        else:
            router = init_attention_router(
                config.num_attention_experts, config.hidden_size, self.router_init, std=config.initializer_range,
                seed=layer_seed(self.options.seed, layer_idx, 2),
            )
        tensors = build_attention_tensors(tensors, router)
        if config.attention_router_type == "noisy_top_k":
            tensors["gate.noise_weight"] = torch.zeros_like(tensors["gate.weight"])  # no noise until trained
        return tensors

    def _fit_routers(self) -> dict[int, torch.Tensor]:
        """`--attn-router-init fit`: one calibration pass of the dense model (the calibration options apply)."""
        if self._fitted is None:
            from .calibrated_methods import calibration_input_ids, dense_model

            o, config = self.options, self.config
            model = dense_model(self)
            self._fitted = fit_attention_routers(
                model, calibration_input_ids(self), config.num_attention_experts,
                layers=config.attention_moe_layers, batch_size=o.calibration_batch_size, progress=o.progress,
            )
        return self._fitted

    @staticmethod
    def active_parameters(config, name: str, numel: int) -> int:
        """q_proj and o_proj of attention-MoE layers count k/E (the heads a token uses); the rest as LlamaMoE."""
        parts = name.split(".")
        if (
            len(parts) > 4
            and parts[3] == "self_attn"
            and parts[4] in ("q_proj", "o_proj")
            and not (parts[4] == "o_proj" and parts[-1] == "bias")
            and int(parts[2]) in config.attention_moe_layers
        ):
            return numel * config.num_attention_experts_per_tok // config.num_attention_experts
        return ModelFamily.active_parameters(config, name, numel)


def card_settings(config, settings: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """The model card's settings rows for an AttnMoE checkpoint: the attention sparsity, and the MLP rows only when
    the MLP is an MoE."""
    experts = (
        f"{config.num_attention_experts} ({config.heads_per_attention_expert} query head(s) each, granularity "
        f"`{config.attention_expert_granularity}`; {config.num_attention_heads} query / "
        f"{config.num_key_value_heads} KV heads)"
    )
    router_init = (config.conversion_info or {}).get("attention_router_init")
    rows = [
        ("Attention experts per layer", experts),
        ("Attention experts per token (top-k)", config.num_attention_experts_per_tok),
        ("Attention MoE layers", f"{len(config.attention_moe_layers)} of {config.num_hidden_layers}"),
        ("Attention router", f"`{config.attention_router_type}`, initialised `{router_init}` (docs/attn_moe.md)"),
        ("Attention score scale factor", config.attention_score_scale_factor),
        (
            "What a token attends to",
            "all earlier tokens (K/V for every token, standard KV cache); only the query heads and o_proj are routed",
        ),
    ]
    if not config.moe_layers:
        keep = {"Seed", "Weights dtype", "Source"}
        return rows + [("MLP", "dense (not converted)")] + [(name, value) for name, value in settings if name in keep]
    return rows + settings


def card_note(config) -> str:
    """What to expect from a converted (untrained) AttnMoE checkpoint, for the model card."""
    return (
        f"Each token uses the query heads of {config.num_attention_experts_per_tok} of {config.num_attention_experts} "
        "attention experts in each attention-MoE layer, chosen by an untrained (or calibration-fitted) router, so "
        "quality is below the dense model until the routers are trained. With top-k equal to the number of attention "
        "experts, a zero router and attention score scale factor equal to that number it computes exactly the dense "
        "model."
    )

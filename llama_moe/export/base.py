"""What every export target shares: a converted LlamaMoE checkpoint described role by role, the refusals common to
all targets, and the transformers targets' writer.

A checkpoint tensor is read once and described as one or more *roles* (`checkpoint_roles`), in the shapes below
(V vocabulary, H hidden, d head size, I dense FFN, E experts, m expert size, S all shared experts' neurons):

    embed [V, H]   norm [H]   lm_head [V, H]                          (lm_head absent with tied embeddings)
    attn_norm [H]   ffn_norm [H]                                      (per layer, as are all below)
    q [nH*d, H]   k [nKV*d, H]   v [nKV*d, H]   o [H, nH*d]
    q_bias [nH*d]   k_bias, v_bias [nKV*d]   o_bias [H]   q_norm, k_norm [d]   (as the source family has them)
    dense_gate [I, H]   dense_up [I, H]   dense_down [H, I]           (layers outside `moe_layers`)
    router [E, H]
    gate_exps [E, m, H]   up_exps [E, m, H]   down_exps [E, H, m]     (the layer's score scale folded into down)
    shexp_gate [S, H]   shexp_up [S, H]   shexp_down [H, S]

A target turns each role into its own tensors (`role_tensors`). That is a pure function of the tensor's shape and
values, so the list of tensors a target writes is planned by running it on meta tensors first.
"""

import re
from collections.abc import Iterator

from ..registry import NoOptions

LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)")
GLOBAL_ROLES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
LAYER_ROLES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.bias": "o_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "dense_gate",
    "mlp.up_proj.weight": "dense_up",
    "mlp.down_proj.weight": "dense_down",
    "mlp.gate.weight": "router",
    "mlp.experts.down_proj": "down_exps",
    "mlp.shared_experts.gate_proj.weight": "shexp_gate",
    "mlp.shared_experts.up_proj.weight": "shexp_up",
    "mlp.shared_experts.down_proj.weight": "shexp_down",
}
FUSED_EXPERTS = "mlp.experts.gate_up_proj"  # [E, 2m, H], the gate rows first: split into gate_exps and up_exps
# Tensors that do not take part in inference, so no target needs them: the noisy router's noise projection (its
# noise is added in training only), and a G-MoEfication compensation table, exported only when it is all zeros.
UNUSED_AT_INFERENCE = ("mlp.gate.noise_weight", "mlp.compensation")

# Why a whole family has no exact counterpart in any target.
REFUSED_FAMILIES = {
    "attn_moe": "it is an AttnMoE model: its attention-head experts (routed query heads) have no counterpart in "
    "Mixtral, Qwen2-MoE or llama.cpp, whose attention is dense",
    "soap_moe": "it is a SoapMoE model: it merges its experts' weights once per segment of tokens (segment "
    "routing), which token-choice top-k MoE layers cannot express",
}


def tensor_order(name: str) -> tuple:
    """Sort key of checkpoint tensors: embeddings, then the layers in order, then the final norm and head."""
    match = LAYER_TENSOR.fullmatch(name)
    if match:
        return (1, int(match[1]), match[2])
    return (0 if name == "model.embed_tokens.weight" else 2, 0, name)


def is_unused_at_inference(name: str) -> bool:
    return name.endswith(UNUSED_AT_INFERENCE)


def checkpoint_roles(config, name: str, tensor) -> Iterator[tuple[str, int | None, object]]:
    """(role, layer or None, tensor) of one LlamaMoE checkpoint tensor; an unknown tensor is refused."""
    if name in GLOBAL_ROLES:
        yield GLOBAL_ROLES[name], None, tensor
        return
    match = LAYER_TENSOR.fullmatch(name)
    part = match[2] if match else None
    if part == FUSED_EXPERTS:
        gate, up = tensor.chunk(2, dim=1)  # [E, m, H] each
        yield "gate_exps", int(match[1]), gate
        yield "up_exps", int(match[1]), up
    elif part == "mlp.experts.down_proj":
        # LlamaMoE scales the routing weights of the layer; scaling each expert's down projection is the same.
        scale = config.layer_score_scale(int(match[1]))
        yield "down_exps", int(match[1]), tensor if scale == 1.0 else tensor * scale
    elif part in LAYER_ROLES:
        yield LAYER_ROLES[part], int(match[1]), tensor
    else:
        raise ValueError(f"The checkpoint holds {name}, which no export target knows how to write.")


def model_reasons(config) -> list[str]:
    """Why no target can export this model exactly (empty: each target's `supports` decides the rest)."""
    if config.model_type in REFUSED_FAMILIES:
        return [REFUSED_FAMILIES[config.model_type]]
    if config.model_type != "llama_moe":
        return [f"it is a {config.model_type!r} model, not a converted LlamaMoE checkpoint (llama_moe)"]
    reasons = []
    refusal = router_class(config).stock_refusal
    if refusal:
        reasons.append(f"router_type {config.router_type!r}: {refusal}")
    if config.mlp_bias:
        reasons.append("mlp_bias: the targets' MLPs have no bias")
    return reasons


def router_class(config):
    """The gate class of a LlamaMoE config: what its routing means (`modeling.routers`)."""
    from llama_moe_hf.modeling.routers import ROUTER_CLASSES, LlamaMoERouter

    return ROUTER_CLASSES.get(config.router_type, LlamaMoERouter)  # a gate with no class says nothing: refused


def keeps_weights_summing_to_one(config) -> bool:
    """Whether a softmax top-k gate renormalises its chosen experts' weights (False for one that keeps them as they
    are; gates no target computes are refused by `model_reasons`)."""
    router = router_class(config)
    return router.renormalizes or router.stock_refusal is not None


def inference_notes(config) -> list[str]:
    """What is exported as inference computes it (a router whose training-time routing differs)."""
    if getattr(config, "router_type", None) is None:  # a dense source
        return []
    note = router_class(config).inference_note
    return [note] if note else []


def attention_reasons(config, target: str, sources: tuple[str, ...]) -> list[str]:
    """Why `target`, whose attention computes that of the source families `sources` exactly, cannot take this
    model's attention (its source family's)."""
    from ..source_families import SOURCE_FAMILIES

    source = config.source_model_type
    if source in sources:
        return []
    features = SOURCE_FAMILIES[source].attention_features if source in SOURCE_FAMILIES else "its own attention"
    usable = [name for name in sources if name in SOURCE_FAMILIES]
    return [f"its source is {source} ({features}), and {target}'s attention is that of {' or '.join(usable)}"]


def window_reasons(config, target: str) -> list[str]:
    """`target` has one attention kind for every layer: refuse a mix of sliding and full layers."""
    if len(set(config.layer_types)) > 1:
        return [f"it mixes sliding-window and full attention layers, and {target} has one kind for every layer"]
    return []


def uniform_window(config) -> int | None:
    """The sliding window of every layer (None: full attention everywhere)."""
    return config.sliding_window if config.layer_types and config.layer_types[0] == "sliding_attention" else None


def dense_layers(config) -> list[int]:
    return sorted(set(range(config.num_hidden_layers)) - set(config.moe_layers))


def per_expert(template: str, layer: int | None, tensor) -> Iterator[tuple[str, object]]:
    """`template` filled in for the layer (`{bid}`) and, when it names one (`{e}`), for each expert of `tensor`'s
    first dimension (views, no copy)."""
    if "{e}" not in template:
        yield template.format(bid=layer), tensor
        return
    for expert in range(tensor.shape[0]):
        yield template.format(bid=layer, e=expert), tensor[expert]


class ExportTarget:
    """A format a converted model is exported to. Subclass, set `description`, register with
    `@TARGETS.register(name)`, and implement `target_reasons`, `role_tensors` and `write`.

    The export calls, in order: `check()` (refuse with every reason `supports` gives, or note), then `write(job)`,
    where `job.tensors()` streams `extra_tensors()` and then `role_tensors(...)` of every checkpoint tensor, in the
    order `job.plan` lists them.
    """

    name = ""  # set by TARGETS.register
    description = ""  # one sentence: `--help` and the docs show it
    Options = NoOptions
    exact = True  # computes what the model computes (README's table lists it); `dense` merges experts instead
    # Dense source families (model_type) the target also writes, so that a dense model and its MoE can be compared
    # through the same writer; `dense_reasons` answers for them.
    dense_sources: tuple[str, ...] = ()

    def __init__(self, config, options=None):
        self.config = config
        self.options = options if options is not None else self.Options()
        self.notes: list[str] = []  # what the user should know about the export (printed by the command)

    @classmethod
    def supports(cls, config) -> list[str]:
        """Why this target cannot represent the model of `config` exactly (empty: it can): what no target takes,
        else every reason of its own (`target_reasons`); for a dense source it takes, `dense_reasons`."""
        if config.model_type in cls.dense_sources:
            return cls.dense_reasons(config)
        return model_reasons(config) or cls.target_reasons(config)

    @classmethod
    def dense_reasons(cls, config) -> list[str]:
        """Why this target cannot represent a dense model of one of its `dense_sources`."""
        return []

    @classmethod
    def target_reasons(cls, config) -> list[str]:
        """Why this target cannot represent a converted LlamaMoE model that the targets in general take."""
        return []

    def check(self) -> None:
        """Refuse (one ValueError with every reason) what this target cannot express exactly; add notes for what it
        exports as inference computes it."""
        reasons = self.supports(self.config)
        if reasons:
            raise ValueError(f"Cannot export this model to {self.name} exactly: {'; '.join(reasons)}.")
        self.notes += inference_notes(self.config)

    def extra_tensors(self) -> Iterator[tuple[str, object]]:
        """Tensors made from the config alone, written first."""
        return iter(())

    def role_tensors(self, role: str, layer: int | None, tensor) -> Iterator[tuple[str, object]]:
        """This target's (name, tensor) pairs for one role of the checkpoint."""
        raise NotImplementedError

    def write(self, job) -> list[str]:
        """Write the export into `job.folder`; return the file names written."""
        raise NotImplementedError


# The roles every transformers LLaMA-family model names alike.
TRANSFORMERS_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{bid}.input_layernorm.weight",
    "ffn_norm": "model.layers.{bid}.post_attention_layernorm.weight",
    "q": "model.layers.{bid}.self_attn.q_proj.weight",
    "k": "model.layers.{bid}.self_attn.k_proj.weight",
    "v": "model.layers.{bid}.self_attn.v_proj.weight",
    "o": "model.layers.{bid}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{bid}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{bid}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{bid}.self_attn.v_proj.bias",
    "o_bias": "model.layers.{bid}.self_attn.o_proj.bias",
    "q_norm": "model.layers.{bid}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{bid}.self_attn.k_norm.weight",
}
# Config fields a LLaMA config shares with Mixtral's and Qwen2-MoE's, with the same meaning.
SHARED_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_dropout",
    "num_experts_per_tok",
    "router_aux_loss_coef",
)


class TransformersTarget(ExportTarget):
    """A transformers model family: safetensors in the family's own checkpoint layout (what its `save_pretrained`
    writes, per-expert tensors), its config, and the source's tokenizer and generation config."""

    names: dict[str, str] = {}  # role -> tensor name template ({bid}: layer, {e}: expert)

    def role_tensors(self, role, layer, tensor):
        yield from per_expert(self.names[role], layer, tensor)

    def target_config(self):
        """The family's config for this checkpoint."""
        raise NotImplementedError

    def shared_config_fields(self) -> dict:
        return {field: getattr(self.config, field) for field in SHARED_CONFIG_FIELDS}

    def write(self, job) -> list[str]:
        from ..checkpoints.writer import ShardedWriter

        writer = ShardedWriter(job.folder, job.plan, job.dtype)
        for name, tensor in job.tensors():
            writer.add(name, tensor)
        files = writer.close()
        if job.dtype.itemsize < 4:  # LlamaMoE's routers compute in float32 whatever the weights' dtype
            self.notes.append(
                f"{self.name} computes router logits in the weights' dtype ({job.dtype}) where LlamaMoE uses float32: "
                "a token whose best experts tie within that rounding can route differently"
            )
        config = self.target_config()
        config.dtype = job.dtype
        config.save_pretrained(job.folder)
        job.checkpoint.save_extras(job.folder)  # tokenizer files, chat template, generation config
        return files

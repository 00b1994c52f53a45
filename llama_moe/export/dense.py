"""A converted LlamaMoE model as a plain dense model of its source family (`LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`: `source_model_type`), each MoE layer's routed experts merged into one FFN.

How the experts become one FFN (`dense_experts`, the `--dense-experts` flag):

    uniform   the mean of the experts' gate, up and down weights (default)
    router    their mean weighted by each expert's mean routing probability: the router's softmax over all experts,
              averaged over 4,096 tokens of the built-in calibration text (Python docstrings, `text.corpus`) that
              the MoE model itself runs, so each router sees its own layer's input
    N         expert N alone

A merged FFN approximates the routed layer, which mixes different experts per token; `uniform` is exact for an
upcycled model without noise (every expert the dense FFN, top-k weights summing to 1). The layer's score scale is
folded into the down projection (`checkpoint_roles`). A SwiGLU FFN is a sum over its neurons, so the shared experts'
neurons follow the merged expert's: the FFN of m + S neurons computes merged expert + shared experts exactly. Layers
outside `moe_layers` keep their FFN; a dense config has one `intermediate_size`, so a smaller FFN is padded with
zero neurons (their down projection columns are zero: exact).

Refused: AttnMoE and SoapMoE models, routers whose top-k weights do not sum to 1 (`switch`, `selector`,
`analytical`), a non-zero compensation table (`check_compensation`), and sources whose attention the export roles do
not carry (Phi-3's fused `qkv_proj`).
"""

import dataclasses

from ..registry import option
from .base import (
    TRANSFORMERS_NAMES,
    ExportTarget,
    attention_reasons,
    model_reasons,
    per_expert,
    router_class,
)
from .registry import TARGETS

CALIBRATION_TOKENS = 4096
CALIBRATION_SEQ_LEN = 256
WEIGHTINGS = ("uniform", "router")
DENSE_SOURCES = ("llama", "mistral", "qwen2", "qwen3")  # families whose tensors the export roles carry
REFUSED_FAMILIES = {
    "attn_moe": "it is an AttnMoE model: its routed attention heads are not merged by the dense target",
    "soap_moe": "it is a SoapMoE model: its dense FFN is its experts merged with one prompt's routing weights "
    "(llama_moe.export.soap_dense.merged_dense_model)",
}
# role -> (the dense FFN's projection, position among the layer's parts: merged or dense FFN, then shared experts)
FFN_PARTS = {
    "gate_exps": ("gate_proj", 0),
    "up_exps": ("up_proj", 0),
    "down_exps": ("down_proj", 0),
    "dense_gate": ("gate_proj", 0),
    "dense_up": ("up_proj", 0),
    "dense_down": ("down_proj", 0),
    "shexp_gate": ("gate_proj", 1),
    "shexp_up": ("up_proj", 1),
    "shexp_down": ("down_proj", 1),
}


@dataclasses.dataclass(frozen=True)
class DenseOptions:
    dense_experts: str = option(
        "uniform",
        "dense: how each MoE layer's experts become one FFN: uniform (their mean), router (their mean weighted by "
        "each expert's mean routing probability over 4,096 built-in calibration tokens), or an expert index (that "
        "expert alone)",
    )


def router_reasons(config) -> list[str]:
    """Why the dense target cannot average this model's experts into one FFN (the gate's `dense_refusal`)."""
    refusal = router_class(config).dense_refusal
    return [refusal.format(router_type=config.router_type)] if refusal else []


@TARGETS.register("dense")
class Dense(ExportTarget):
    description = (
        "the source family's dense model (LlamaForCausalLM, Qwen3ForCausalLM, ...): each MoE layer's experts merged "
        "into one FFN (--dense-experts: uniform mean, router-weighted mean, or one expert), shared experts' neurons "
        "appended; exact for an upcycled model."
    )
    Options = DenseOptions
    exact = False

    def __init__(self, config, options=None):
        super().__init__(config, options)
        self._pending: dict[tuple[int, str], dict[int, object]] = {}  # one layer's FFN parts until all arrived
        self.expert_weights: dict[int, object] = {}  # MoE layer -> [E] weights of the merge

    @classmethod
    def supports(cls, config) -> list[str]:
        if config.model_type in REFUSED_FAMILIES:
            return [REFUSED_FAMILIES[config.model_type]]
        if config.model_type != "llama_moe":
            return model_reasons(config)
        return cls.target_reasons(config)

    @classmethod
    def target_reasons(cls, config) -> list[str]:
        reasons = router_reasons(config)
        if config.mlp_bias:
            reasons.append("mlp_bias: the dense target merges bias-free experts")
        return reasons + attention_reasons(config, "dense", DENSE_SOURCES)

    def check(self) -> None:
        super().check()
        weighting, experts = str(self.options.dense_experts), self.config.num_experts
        if weighting not in WEIGHTINGS and not (weighting.isdigit() and int(weighting) < experts):
            raise ValueError(
                f"--dense-experts must be uniform, router or an expert index from 0 to {experts - 1}, got {weighting!r}."
            )
        self.expert_weights = {layer: self.fixed_weights() for layer in self.config.moe_layers}
        self.notes += self.merge_notes()

    def fixed_weights(self):
        """[E] weights of `uniform` or of one expert (`router`'s are computed when writing; uniform until then)."""
        import torch

        weighting, experts = str(self.options.dense_experts), self.config.num_experts
        if weighting.isdigit():
            return torch.nn.functional.one_hot(torch.tensor(int(weighting)), experts).float()
        return torch.full((experts,), 1 / experts)

    def merge_notes(self) -> list[str]:
        weighting, config = str(self.options.dense_experts), self.config
        how = {
            "uniform": "averaged (exact only when every expert is the same FFN, as upcycling without noise makes them)",
            "router": (
                f"averaged, weighted by their mean routing probability over {CALIBRATION_TOKENS} tokens of the "
                "built-in calibration text"
            ),
        }.get(weighting, f"replaced by expert {weighting}")
        notes = [f"each MoE layer's routed experts are {how}: the dense model approximates the MoE's routing"]
        if len(set(self.ffn_sizes())) > 1:
            notes.append(
                f"every FFN is padded with zero neurons to {max(self.ffn_sizes())} (sizes per layer: "
                f"{self.ffn_sizes()}), which adds nothing to its output"
            )
        return notes if config.moe_layers else []

    def ffn_sizes(self) -> list[int]:
        """Each layer's FFN neurons: merged expert and shared experts in MoE layers, the dense FFN elsewhere."""
        c = self.config
        moe = c.moe_intermediate_size + c.num_shared_experts * c.shared_expert_intermediate_size
        return [moe if layer in c.moe_layers else c.intermediate_size for layer in range(c.num_hidden_layers)]

    def role_tensors(self, role, layer, tensor):
        if role == "router":
            return
        if role not in FFN_PARTS:
            yield from per_expert(TRANSFORMERS_NAMES[role], layer, tensor)
            return
        if role.endswith("_exps"):
            tensor = self.merged(layer, tensor)
        projection, position = FFN_PARTS[role]
        parts = self._pending.setdefault((layer, projection), {})
        parts[position] = tensor
        expected = 2 if layer in self.config.moe_layers and self.config.num_shared_experts else 1
        if len(parts) == expected:
            del self._pending[layer, projection]
            yield f"model.layers.{layer}.mlp.{projection}.weight", self.padded(projection, parts)

    def merged(self, layer: int, tensor):
        """The experts `tensor` [E, ...] weighted by the layer's expert weights, summed (in float32)."""
        import torch

        return torch.tensordot(self.expert_weights[layer].to(tensor.device), tensor.float(), dims=1)

    def padded(self, projection: str, parts: dict):
        """The parts in order along the neuron dimension, zero neurons after them up to the largest FFN."""
        import torch

        dim = 1 if projection == "down_proj" else 0
        ffn = torch.cat([parts[i].float() for i in sorted(parts)], dim=dim)
        missing = max(self.ffn_sizes()) - ffn.shape[dim]
        return torch.nn.functional.pad(ffn, (0, missing) if dim else (0, 0, 0, missing))

    def target_config(self):
        from ..source_families import SOURCE_FAMILIES

        family = SOURCE_FAMILIES[self.config.source_model_type]()
        config_class = family.config_class()
        names = {field.name for field in dataclasses.fields(config_class)}
        values = {k: v for k, v in self.config.to_dict().items() if k in names and k != "dtype"}
        values.update(intermediate_size=max(self.ffn_sizes()), architectures=[family.model_class().__name__])
        return config_class(**values)

    def write(self, job) -> list[str]:
        from ..checkpoints.writer import ShardedWriter

        if str(self.options.dense_experts) == "router":
            self.expert_weights = folder_routing_probabilities(job.checkpoint.path)
        writer = ShardedWriter(job.folder, job.plan, job.dtype)
        for name, tensor in job.tensors():
            writer.add(name, tensor)
        files = writer.close()
        config = self.target_config()
        config.dtype = job.dtype
        config.save_pretrained(job.folder)
        job.checkpoint.save_extras(job.folder)  # tokenizer files, chat template, generation config
        return files


def calibration_tokens(tokenizer, seq_len: int = CALIBRATION_SEQ_LEN):
    """[B, seq_len] ids of the first `CALIBRATION_TOKENS` tokens of the built-in calibration text."""
    from ..conversion.calibration import tokenize_calibration
    from ..text.documents import load_texts

    texts, _ = load_texts(None)
    return tokenize_calibration(texts, tokenizer, CALIBRATION_TOKENS, seq_len)


def folder_routing_probabilities(folder) -> dict[int, object]:
    """`mean_routing_probabilities` of the converted model in `folder` over the built-in calibration tokens."""
    from ..loading import load_model

    model, tokenizer, _ = load_model(str(folder))
    seq_len = min(CALIBRATION_SEQ_LEN, model.config.max_position_embeddings)
    return mean_routing_probabilities(model, calibration_tokens(tokenizer, seq_len))


def mean_routing_probabilities(model, input_ids, batch_size: int = 4) -> dict[int, object]:
    """MoE layer -> [E] mean over the tokens of `input_ids` of its router's softmax over all experts."""
    import torch

    layers = sorted(model.config.moe_layers)
    total = torch.zeros(len(layers), model.config.num_experts)
    with torch.no_grad():
        for batch in input_ids.split(batch_size):
            out = model(batch.to(model.device), output_router_logits=True, logits_to_keep=1, use_cache=False)
            total += torch.stack([logits.float().softmax(-1).sum(0).cpu() for logits in out.router_logits])
    return dict(zip(layers, total / input_ids.numel()))

"""Per-GPU memory of full fine-tuning with AdamW in bf16 mixed precision, from parameter counts alone.

Model states only: weights, gradients, AdamW states, and the transient full copies that sharded training all-gathers.
Activations are NOT included (they depend on batch, sequence length and checkpointing); `activation_bytes_per_token`
gives a separate, rough estimate. Bytes per parameter (Psi = total parameters, N = GPUs):

    DDP (torch autocast, accelerate `mixed_precision: bf16`): fp32 weights 4 (they are the master copy), fp32
        gradients 4, DDP's flat all-reduce buckets 4 (a second gradient copy unless `gradient_as_bucket_view=True`;
        N > 1 only), Adam moments 4 + 4, and the bf16 copies autocast makes of every weight 2 (alive from the
        forward to the backward)                                              -> 22 Psi (18 on one GPU)
    ZeRO-2 (DeepSpeed bf16): bf16 weights 2 on every GPU; bf16 gradients 2, fp32 master 4, moments 4 + 4
        partitioned                                                           -> 2 Psi + 14 Psi / N
    ZeRO-3: all of the 16 bytes partitioned                                   -> 16 Psi / N + gathered
    FSDP2 full shard (bf16 MixedPrecisionPolicy): sharded fp32 weights 4 (the master), fp32 gradients 4,
        moments 4 + 4                                                         -> 16 Psi / N + gathered

"gathered" (ZeRO-3, FSDP2) is an estimate of the all-gathered bf16 working set: the parameters outside the decoder
layers (embeddings, final norm, LM head: FSDP2's root unit, which stays gathered from forward to backward), two
decoder layers (the one computing and the one prefetched) and one layer's unsharded gradients before their
reduce-scatter. Allocator fragmentation, the CUDA context and communication buffers come on top of all of this.
"""

import dataclasses
import math

GIB = 1024**3
STRATEGIES = ("ddp", "zero2", "zero3", "fsdp2")
STRATEGY_NAMES = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp2": "FSDP2"}
BF16, FP32 = 2, 4


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    total: int
    active: int  # used per token: routed experts count k/E of their size (the conversion's own rule)
    largest_layer: int  # the biggest decoder layer: one FSDP2 unit, what ZeRO-3 gathers for one layer
    outside_layers: int  # embeddings, final norm and LM head (counted once when tied)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of one strategy on `num_gpus` GPUs (model states only, no activations)."""

    strategy: str
    num_gpus: int
    weights: float
    gradients: float
    optimizer: float  # fp32 master weights (where separate) and both Adam moments
    working: float  # transient copies: autocast's bf16 weights (DDP), the all-gathered units (ZeRO-3, FSDP2)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.working


def meta_model(config):
    """The causal LM of `config` on the meta device: shapes only, no memory, no download."""
    import torch
    from transformers import AutoModelForCausalLM

    import llama_moe_hf  # noqa: F401  (registers the MoE families with the Auto classes)

    # The class itself, not `from_config`: under a ZeRO-3 TrainingArguments that would start deepspeed.zero.Init
    # before the run has set up its processes.
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"):
        return model_class(config)


def parameter_counts(config, model=None) -> ParameterCounts:
    """Total and active parameters of a dense LLaMA config or any of this package's MoE configs, exactly, from the
    parameter shapes of a meta-device model (`model`, or one built; tied weights counted once)."""
    from ..conversion.pipeline import count_parameters
    from ..conversion.registry import FAMILIES

    model = model if model is not None else meta_model(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.model_type in FAMILIES:
        total, active = count_parameters(config, shapes)
    else:  # dense: every parameter is used by every token
        total = active = sum(math.prod(shape) for shape in shapes.values())
    layers = [0] * config.num_hidden_layers
    for name, shape in shapes.items():
        if name.startswith("model.layers."):
            layers[int(name.split(".")[2])] += math.prod(shape)
    return ParameterCounts(total, active, max(layers), total - sum(layers))


def moe_config(dense_config, **recipe_fields):
    """The MoE config a conversion of `dense_config` would write (e.g. `method="upcycle", num_experts=8,
    top_k=2`), resolved by the conversion's own planner: no weights are read."""
    from ..conversion.plan import ConversionPlan
    from ..conversion.recipe import MoERecipe

    return ConversionPlan.create(MoERecipe.from_dict(recipe_fields), dense_config).config


def _gathered(counts: ParameterCounts) -> float:
    """Estimate of the all-gathered bf16 working set of ZeRO-3 / FSDP2 (see the module docstring)."""
    params = counts.outside_layers + 2 * counts.largest_layer
    grads = max(counts.outside_layers, counts.largest_layer)
    return BF16 * (params + grads)


def estimate_memory(counts: ParameterCounts, strategy: str, num_gpus: int) -> MemoryEstimate:
    """Per-GPU bytes of full fine-tuning with AdamW, bf16 mixed precision, under `strategy` on `num_gpus` GPUs."""
    psi, n = counts.total, num_gpus
    if strategy == "ddp":
        buckets = FP32 * psi if n > 1 else 0  # one process trains without DDP
        return MemoryEstimate(strategy, n, FP32 * psi, FP32 * psi + buckets, 2 * FP32 * psi, BF16 * psi)
    if strategy == "zero2":
        return MemoryEstimate(strategy, n, BF16 * psi, BF16 * psi / n, 3 * FP32 * psi / n, 0.0)
    if strategy == "zero3":
        return MemoryEstimate(strategy, n, BF16 * psi / n, BF16 * psi / n, 3 * FP32 * psi / n, _gathered(counts))
    if strategy == "fsdp2":
        return MemoryEstimate(strategy, n, FP32 * psi / n, FP32 * psi / n, 2 * FP32 * psi / n, _gathered(counts))
    raise ValueError(f"Unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")


def activation_bytes_per_token(config) -> float:
    """ROUGH ESTIMATE of activation memory per training token with gradient checkpointing on every decoder layer,
    bf16, for LLaMA-style layers with token-choice routing. Three terms:

    - the checkpointed input of every decoder layer: 2 H bytes per layer;
    - one decoder layer recomputed in the backward, all its intermediates alive at once: attention (norm output,
      q, k, v, attention output, o_proj output) and MLP (per selected expert the gate, up and product of width
      I_e plus the gathered input row, shared experts as a dense MLP of their width, or the dense MLP);
    - the logits: bf16, their fp32 upcast for the loss, and its fp32 gradient: 10 bytes per vocabulary entry.

    Not counted: attention kernels' workspace, routing index tensors, allocator slack. Use it for orders of
    magnitude, not to size a run to the last GiB.
    """
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    attention = 3 * hidden + q_width + 2 * kv_width + q_width
    num_experts = getattr(config, "num_experts", None)
    if num_experts and getattr(config, "moe_layers", None):
        top_k = config.num_experts_per_tok or num_experts
        shared = getattr(config, "num_shared_experts", 0) * (getattr(config, "shared_expert_intermediate_size", 0) or 0)
        mlp = top_k * (3 * config.moe_intermediate_size + hidden) + 3 * shared
    else:
        mlp = 3 * config.intermediate_size
    layer = BF16 * (attention + mlp)
    checkpoints = BF16 * hidden * config.num_hidden_layers
    logits = (BF16 + 2 * FP32) * config.vocab_size
    return checkpoints + layer + logits


# ---------------------------------------------------------------------------------------------------------------
# Published dense models, by their config.json fields (no download needed)
# ---------------------------------------------------------------------------------------------------------------


def smollm2_135m_config():
    """HuggingFaceTB/SmolLM2-135M(-Instruct): the package's built-in default model."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )


def llama2_7b_config():
    """meta-llama/Llama-2-7b-hf."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def llama3_8b_config():
    """meta-llama/Meta-Llama-3-8B."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )

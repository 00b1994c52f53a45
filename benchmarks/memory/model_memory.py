"""What the memory benchmarks need beyond the training preflight's own estimate (`llama_moe.footprint`:
parameter counts, `estimate_memory` per strategy, whose comment lists the bytes per parameter of each): the strategies'
display names, a rough activation estimate per token, and the configs of published dense models.

Used by `memory_table.py` and the memory-model tests; needs no download.
"""

from llama_moe.footprint import BF16, FP32

STRATEGY_NAMES = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp2": "FSDP2"}


def activation_bytes_per_token(config) -> float:
    """ROUGH ESTIMATE of activation memory per training token with gradient checkpointing on every decoder layer,
    bf16, for LLaMA-style layers with token-choice routing. Three terms:

    - the checkpointed input of every decoder layer: 2 H bytes per layer;
    - one decoder layer recomputed in the backward, all its intermediates alive at once: attention (norm output,
      q, k, v, attention output, o_proj output) and MLP (per selected expert the gate, up and product of width
      I_e plus the gathered input row, shared experts as a dense MLP of their width, or the dense MLP);
    - the logits: bf16, their fp32 upcast for the loss, and its fp32 gradient: 10 bytes per vocabulary entry.

    Not counted: attention kernels' workspace, routing index tensors, allocator slack. Use it for orders of
    magnitude, not to size a run to the last GiB (the preflight's `footprint.activation_bytes` is the closer one).
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

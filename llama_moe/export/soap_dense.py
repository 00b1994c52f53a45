"""A SoapMoE model with prompt routing as the dense LLaMA it runs for one prompt: each SOAP layer's experts merged
with that prompt's routing weights into one FFN (docs/soap.md, "Dense export of a prompt"). Exact: generation from
the dense model equals the SoapMoE model's (`tests/modeling/test_soap_moe.py`)."""

import dataclasses

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def merged_dense_model(model, routing_weights: tuple[torch.Tensor, ...]) -> LlamaForCausalLM:
    """A dense LLaMA whose FFN in each SOAP layer of `model` (a `SoapMoEForCausalLM`) is that layer's experts merged
    with one row of routing weights (`routing_weights[i]` `[E]`, in `config.moe_layers` order): what prompt routing
    runs for one prompt."""
    if model.config.num_shared_experts or model.config.source_model_type != "llama":
        raise ValueError("Only a LLaMA-sourced model without shared experts has a dense LLaMA equivalent.")
    llama_fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    config = LlamaConfig(**{k: v for k, v in model.config.to_dict().items() if k in llama_fields})
    with torch.device(model.device):
        dense = LlamaForCausalLM(config).to(model.dtype)
    dense.load_state_dict(merged_dense_state_dict(model, routing_weights), strict=not config.tie_word_embeddings)
    return dense.eval()


def merged_dense_state_dict(model, routing_weights: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """`model`'s state dict with each SOAP layer's router and experts replaced by the merged FFN's LLaMA MLP."""
    state = {k: v for k, v in model.state_dict().items() if ".mlp.gate." not in k and ".mlp.experts." not in k}
    size = model.config.moe_intermediate_size
    for layer_idx, weights in zip(model.config.moe_layers, routing_weights):
        experts = model.model.layers[layer_idx].mlp.experts
        index = torch.arange(experts.num_experts, device=weights.device)[None]
        gate_up, down = (merged[0] for merged in experts.merge(weights[None], index))
        scale = model.config.layer_score_scale(layer_idx)
        prefix = f"model.layers.{layer_idx}.mlp."
        state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"] = gate_up[:size], gate_up[size:]
        state[prefix + "down_proj.weight"] = down * scale
    return state

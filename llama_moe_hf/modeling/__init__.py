"""Model families of llama-moe-hf. Importing this module registers them with the transformers Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_attn_moe import AttnMoEConfig
from .configuration_llama_moe import LlamaMoEConfig
from .modeling_attn_moe import AttnMoEForCausalLM, AttnMoEModel
from .modeling_llama_moe import LlamaMoEForCausalLM, LlamaMoEModel

AutoConfig.register(LlamaMoEConfig.model_type, LlamaMoEConfig, exist_ok=True)
AutoModel.register(LlamaMoEConfig, LlamaMoEModel, exist_ok=True)
AutoModelForCausalLM.register(LlamaMoEConfig, LlamaMoEForCausalLM, exist_ok=True)
AutoConfig.register(AttnMoEConfig.model_type, AttnMoEConfig, exist_ok=True)
AutoModel.register(AttnMoEConfig, AttnMoEModel, exist_ok=True)
AutoModelForCausalLM.register(AttnMoEConfig, AttnMoEForCausalLM, exist_ok=True)

# save_pretrained copies the modeling files next to the weights and writes `auto_map`, so a saved folder loads with
# trust_remote_code=True where this package is not installed.
LlamaMoEConfig.register_for_auto_class()
LlamaMoEModel.register_for_auto_class("AutoModel")
LlamaMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")
AttnMoEConfig.register_for_auto_class()
AttnMoEModel.register_for_auto_class("AutoModel")
AttnMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "AttnMoEConfig",
    "AttnMoEForCausalLM",
    "AttnMoEModel",
    "LlamaMoEConfig",
    "LlamaMoEForCausalLM",
    "LlamaMoEModel",
]

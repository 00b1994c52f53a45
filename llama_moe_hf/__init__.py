"""llama-moe-hf: turn dense LLaMA-family checkpoints into Mixture-of-Experts models for transformers."""

from .conversion import ConversionOptions, convert_to_moe, push_folder
from .modeling import (
    AttnMoEConfig,
    AttnMoEForCausalLM,
    AttnMoEModel,
    LlamaMoEConfig,
    LlamaMoEForCausalLM,
    LlamaMoEModel,
)

__version__ = "0.1.0"

__all__ = [
    "AttnMoEConfig",
    "AttnMoEForCausalLM",
    "AttnMoEModel",
    "ConversionOptions",
    "LlamaMoEConfig",
    "LlamaMoEForCausalLM",
    "LlamaMoEModel",
    "__version__",
    "convert_to_moe",
    "push_folder",
]

"""llama-moe-hf: turn dense LLaMA-family checkpoints into Mixture-of-Experts models for transformers."""

from .modeling import LlamaMoEConfig, LlamaMoEForCausalLM, LlamaMoEModel

__version__ = "0.1.0"

__all__ = ["LlamaMoEConfig", "LlamaMoEForCausalLM", "LlamaMoEModel", "__version__"]

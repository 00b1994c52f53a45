"""llama-moe-hf: turn dense LLaMA-family checkpoints into Mixture-of-Experts models for transformers.

`import llama_moe_hf` registers the model families with transformers' Auto classes, so it is all
`AutoModelForCausalLM.from_pretrained` needs; the rest of the API below is imported on first use. In the `llama-moe`
command (`llama_moe_cli`), registration waits for a command that loads a model: it imports torch, which takes
seconds, and `--help` answers at once.
"""

import importlib
import sys

__version__ = "0.2.0"  # the model code's LLAMA_MOE_VERSION, which setup.py reads (tests/test_structure.py)

_EXPORTS = {
    "AttnMoEConfig": "llama_moe_hf.modeling",
    "AttnMoEForCausalLM": "llama_moe_hf.modeling",
    "AttnMoEForSequenceClassification": "llama_moe_hf.modeling",
    "AttnMoEForTokenClassification": "llama_moe_hf.modeling",
    "AttnMoEModel": "llama_moe_hf.modeling",
    "LlamaMoEConfig": "llama_moe_hf.modeling",
    "LlamaMoEForCausalLM": "llama_moe_hf.modeling",
    "LlamaMoEForSequenceClassification": "llama_moe_hf.modeling",
    "LlamaMoEForTokenClassification": "llama_moe_hf.modeling",
    "LlamaMoEModel": "llama_moe_hf.modeling",
    "SoapMoEConfig": "llama_moe_hf.modeling",
    "SoapMoEForCausalLM": "llama_moe_hf.modeling",
    "SoapMoEForSequenceClassification": "llama_moe_hf.modeling",
    "SoapMoEForTokenClassification": "llama_moe_hf.modeling",
    "SoapMoEModel": "llama_moe_hf.modeling",
    "MoERecipe": "llama_moe_hf.conversion.recipe",
    "RunOptions": "llama_moe_hf.conversion.recipe",
    "load_recipe": "llama_moe_hf.conversion.recipe",
    "save_recipe": "llama_moe_hf.conversion.recipe",
    "METHODS": "llama_moe_hf.conversion.registry",
    "ROUTER_INITS": "llama_moe_hf.conversion.registry",
    "FAMILIES": "llama_moe_hf.conversion.registry",
    "build_moe": "llama_moe_hf.conversion.build",
    "convert": "llama_moe_hf.conversion.pipeline",
    "convert_to_moe": "llama_moe_hf.conversion.pipeline",
    "ConversionResult": "llama_moe_hf.conversion.pipeline",
    "push_folder": "llama_moe_hf.conversion.hub",
    "batch_similar": "llama_moe_hf.similarity.pipeline",
    "BatchSimilarOptions": "llama_moe_hf.similarity.options",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if "llama_moe_cli" not in sys.modules:
    importlib.import_module("llama_moe_hf.modeling")  # registers the families with the Auto classes

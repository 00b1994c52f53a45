"""llama-moe: the tools that turn dense LLaMA-like checkpoints into Mixture-of-Experts models (conversion, healing,
merging, export, the `llama-moe` command). The model code they write is `llama_moe_hf`'s, which registers the
families with transformers' Auto classes when imported.

This package imports nothing heavy: `llama-moe --help` and argument errors answer before torch is imported. The API
below is imported on first use, with the model code (`llama_moe_hf`).
"""

import importlib

API = {
    "MoERecipe": "llama_moe.conversion.recipe",
    "RunOptions": "llama_moe.conversion.recipe",
    "load_recipe": "llama_moe.conversion.recipe",
    "save_recipe": "llama_moe.conversion.recipe",
    "METHODS": "llama_moe.conversion.registry",
    "ROUTER_INITS": "llama_moe.conversion.registry",
    "FAMILIES": "llama_moe.conversion.registry",
    "build_moe": "llama_moe.conversion.build",
    "convert": "llama_moe.conversion.pipeline",
    "convert_to_moe": "llama_moe.conversion.pipeline",
    "ConversionResult": "llama_moe.conversion.pipeline",
    "push_folder": "llama_moe.hub.push",
    "batch_similar": "llama_moe.similarity.pipeline",
    "BatchSimilarOptions": "llama_moe.similarity.options",
    "use_threaded_lm_head": "llama_moe.lm_head",
    "use_threaded_linears": "llama_moe.lm_head",
}
__all__ = sorted(API)


def __getattr__(name: str):
    if name not in API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module("llama_moe_hf")  # the API loads and writes the families: registered first
    value = getattr(importlib.import_module(API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

"""llama-moe-hf: turn dense LLaMA-like checkpoints into Mixture-of-Experts models for transformers.

`import llama_moe_hf` registers the model families with transformers' Auto classes, so it is all
`AutoModelForCausalLM.from_pretrained` needs; the rest of the API below is imported on first use. Registering imports
torch (seconds), so it happens when transformers is imported (at once if it already is): the `llama-moe` command,
which imports this package, answers `--help` without either.
"""

import importlib
import importlib.abc
import sys

__version__ = "0.4.1"  # the model code's LLAMA_MOE_VERSION, which setup.py reads (tests/package/test_structure.py)

_EXPORTS = {
    "AttnMoEConfig": "llama_moe_hf.modeling",
    "AttnMoEForCausalLM": "llama_moe_hf.modeling",
    "AttnMoEForQuestionAnswering": "llama_moe_hf.modeling",
    "AttnMoEForSequenceClassification": "llama_moe_hf.modeling",
    "AttnMoEForTokenClassification": "llama_moe_hf.modeling",
    "AttnMoEModel": "llama_moe_hf.modeling",
    "LlamaMoEConfig": "llama_moe_hf.modeling",
    "LlamaMoEForCausalLM": "llama_moe_hf.modeling",
    "LlamaMoEForQuestionAnswering": "llama_moe_hf.modeling",
    "LlamaMoEForSequenceClassification": "llama_moe_hf.modeling",
    "LlamaMoEForTokenClassification": "llama_moe_hf.modeling",
    "LlamaMoEModel": "llama_moe_hf.modeling",
    "SoapMoEConfig": "llama_moe_hf.modeling",
    "SoapMoEForCausalLM": "llama_moe_hf.modeling",
    "SoapMoEForQuestionAnswering": "llama_moe_hf.modeling",
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
    "push_folder": "llama_moe_hf.hub.push",
    "batch_similar": "llama_moe_hf.similarity.pipeline",
    "BatchSimilarOptions": "llama_moe_hf.similarity.options",
    "use_threaded_lm_head": "llama_moe_hf.lm_head",
    "use_threaded_linears": "llama_moe_hf.lm_head",
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


class _RegisterWithTransformers(importlib.abc.MetaPathFinder):
    """Registers the model families (imports `llama_moe_hf.modeling`) right after `transformers` is imported: the
    other finders find it, and its loader runs as usual first."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        finders = [finder for finder in sys.meta_path if finder is not self and hasattr(finder, "find_spec")]
        spec = next((s for s in (f.find_spec(name, path, target) for f in finders) if s is not None), None)
        if spec is not None and spec.loader is not None:
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                importlib.import_module("llama_moe_hf.modeling")

            spec.loader.exec_module = exec_module
        return spec


if "transformers" in sys.modules:
    importlib.import_module("llama_moe_hf.modeling")  # registers the families with the Auto classes
elif not any(isinstance(finder, _RegisterWithTransformers) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithTransformers())

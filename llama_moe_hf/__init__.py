"""llama-moe-hf's model families for transformers: `import llama_moe_hf` registers LlamaMoE, AttnMoE and SoapMoE with
transformers' Auto classes (`AutoModelForCausalLM.from_pretrained` then loads a converted folder) and does nothing
else. The conversion tools and the `llama-moe` command are the `llama_moe` package; their Python API is reachable
from here too (`llama_moe_hf.convert_to_moe`), imported on first use.
"""

from . import modeling  # importing the model code registers the families with the Auto classes
from .modeling import *  # noqa: F403  (the model classes, as `llama_moe_hf.LlamaMoEForCausalLM`)

__version__ = "0.4.1"  # the model code's LLAMA_MOE_VERSION, which setup.py reads (tests/package/test_structure.py)
__all__ = [*modeling.__all__, "__version__"]  # and the API of `llama_moe` (`llama_moe.API`), forwarded by __getattr__


def __getattr__(name: str):
    import llama_moe

    if name not in llama_moe.API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(llama_moe, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    import llama_moe

    return sorted([*__all__, *llama_moe.API])

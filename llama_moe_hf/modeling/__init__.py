"""Model families of llama-moe-hf. Importing this module registers them with the transformers Auto classes.

Each family's config and heads are also registered for `save_pretrained`'s remote code: it copies the family's
configuration and modeling files, and every file they import relatively (routers.py, moe_kernels.py, ...), next to
the weights and writes `auto_map` (every head: `save_hooks.SaveWithHooksMixin.add_auto_map`), so a saved folder
loads with `trust_remote_code=True` where this package is not installed. docs/modeling.md lists the files.
"""

import transformers

from . import modeling_attn_moe, modeling_llama_moe, modeling_soap_moe
from .configuration_attn_moe import AttnMoEConfig
from .configuration_llama_moe import LlamaMoEConfig
from .configuration_soap_moe import SoapMoEConfig
from .modeling_attn_moe import (
    AttnMoEForCausalLM,
    AttnMoEForQuestionAnswering,
    AttnMoEForSequenceClassification,
    AttnMoEForTokenClassification,
    AttnMoEModel,
    AttnMoEPreTrainedModel,
)
from .modeling_llama_moe import (
    LlamaMoEForCausalLM,
    LlamaMoEForQuestionAnswering,
    LlamaMoEForSequenceClassification,
    LlamaMoEForTokenClassification,
    LlamaMoEModel,
    LlamaMoEPreTrainedModel,
)
from .modeling_soap_moe import (
    SoapMoEForCausalLM,
    SoapMoEForQuestionAnswering,
    SoapMoEForSequenceClassification,
    SoapMoEForTokenClassification,
    SoapMoEModel,
    SoapMoEPreTrainedModel,
)

# config class -> the family's pretrained base class (whose `auto_heads` name its heads) and module
MODEL_FAMILIES = {
    LlamaMoEConfig: (LlamaMoEPreTrainedModel, modeling_llama_moe),
    AttnMoEConfig: (AttnMoEPreTrainedModel, modeling_attn_moe),
    SoapMoEConfig: (SoapMoEPreTrainedModel, modeling_soap_moe),
}

for _config_class, (_base, _module) in MODEL_FAMILIES.items():
    transformers.AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)
    _config_class.register_for_auto_class()
    for _auto_name, _class_name in _base.auto_heads.items():
        _auto_class, _model_class = getattr(transformers, _auto_name), getattr(_module, _class_name)
        _auto_class.register(_config_class, _model_class, exist_ok=True)
        _model_class.register_for_auto_class(_auto_name)

__all__ = [
    "MODEL_FAMILIES",
    "AttnMoEConfig",
    "AttnMoEForCausalLM",
    "AttnMoEForQuestionAnswering",
    "AttnMoEForSequenceClassification",
    "AttnMoEForTokenClassification",
    "AttnMoEModel",
    "LlamaMoEConfig",
    "LlamaMoEForCausalLM",
    "LlamaMoEForQuestionAnswering",
    "LlamaMoEForSequenceClassification",
    "LlamaMoEForTokenClassification",
    "LlamaMoEModel",
    "SoapMoEConfig",
    "SoapMoEForCausalLM",
    "SoapMoEForQuestionAnswering",
    "SoapMoEForSequenceClassification",
    "SoapMoEForTokenClassification",
    "SoapMoEModel",
]

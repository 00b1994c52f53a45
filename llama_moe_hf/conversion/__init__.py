"""Dense -> MoE conversion: expert construction, streaming checkpoint conversion, model cards and Hub upload."""

from . import calibrated_methods  # noqa: F401, E402  (registers the calibrated methods in METHODS)
from .attention import AttnMoEFamily  # noqa: E402
from .convert import (
    FAMILIES,
    METHODS,
    ConversionOptions,
    ConversionResult,
    ExpertMethod,
    ModelFamily,
    SplitMethod,
    convert_to_moe,
    count_parameters,
)
from .hub import push_folder

FAMILIES["attn_moe"] = AttnMoEFamily

__all__ = [
    "FAMILIES",
    "METHODS",
    "ConversionOptions",
    "ConversionResult",
    "ExpertMethod",
    "ModelFamily",
    "SplitMethod",
    "convert_to_moe",
    "count_parameters",
    "push_folder",
]

"""Exact export of converted models into formats that run without this package:

    mixtral     transformers' MixtralForCausalLM     (mixtral.py)
    qwen2_moe   transformers' Qwen2MoeForCausalLM    (qwen2_moe.py)
    qwen3_moe   transformers' Qwen3MoeForCausalLM    (qwen3_moe.py, for Qwen3 sources)
    gguf        llama.cpp's GGUF, Mixtral layout     (gguf.py)
    dense       the source family's dense model, experts merged into one FFN (dense.py; not exact in general)

`export_model(model_folder, to, output)` streams the checkpoint tensor by tensor into an atomic output folder, after
the target has refused (one ValueError with every reason its `supports(config)` gives, nothing written) whatever it
cannot express exactly. Importing this package
registers the targets in `TARGETS` and imports nothing heavy (the command line reads them before torch).
"""

import importlib

from .pipeline import ExportOptions, ExportResult, export_model
from .registry import TARGETS

for _module in ("mixtral", "qwen2_moe", "qwen3_moe", "gguf", "dense"):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["TARGETS", "ExportOptions", "ExportResult", "export_model"]

"""Dense source families: the transformers architectures a conversion reads, one module each.

    llama.py  mistral.py  qwen2.py  qwen3.py  phi3.py

Adding one is a module that registers a `SourceFamily` subclass under the family's `model_type` (and its tests:
the upcycled model and the every-expert-on split equal the dense logits, tests/conversion/test_source_families.py). The CLI's
help, the README table and the recipe schema list `SOURCE_FAMILIES`. Importing this package imports nothing heavy.
"""

import importlib
import pkgutil

from .base import SOURCE_FAMILIES, SourceFamily, dense_config_fields, source_family

for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name != "llama"):  # LLaMA first, as listed
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["SOURCE_FAMILIES", "SourceFamily", "dense_config_fields", "source_family"]

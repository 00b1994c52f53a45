"""Construction methods, one module each; importing this package registers them all in `registry.METHODS`."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

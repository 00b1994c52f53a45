"""The export targets, registered by name like the conversion's components (`llama_moe.registry`):

    TARGETS   where `llama-moe export --to NAME` writes a converted model (one module each in `export/`)

A target is an `ExportTarget` subclass (`export/base.py`) registered with `@TARGETS.register(name)`, with a one-line
`description` and `Options` (a dataclass whose fields become `llama-moe export` flags). This module imports nothing
heavy: the command line reads it before torch is imported.
"""

from ..registry import Registry

TARGETS = Registry("export target", "export targets")

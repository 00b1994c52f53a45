"""The conversion's extension points (the machinery is `llama_moe.registry`'s):

    METHODS        construction methods: how a dense block becomes experts (`methods/`, one module each)
    ROUTER_INITS   router initialisations: where a new router's weights come from (`routers/`, one module each)
    FAMILIES       model families: the output config and model classes, card rows, `info` lines (`families/`)

Their options are the flags of `llama-moe convert` and the keys of a recipe file, so they share one namespace.
This module imports nothing heavy: the command line reads the registries before torch is imported.
"""

from ..registry import NoOptions, Registry, component_options, option, option_fields, option_names

REGISTRIES: list[Registry] = []  # the namespace of the convert flags
METHODS = Registry("construction method", "construction methods", REGISTRIES)
ROUTER_INITS = Registry("router initialisation", "router initialisations", REGISTRIES)
FAMILIES = Registry("model family", "model families", REGISTRIES)

__all__ = [
    "FAMILIES",
    "METHODS",
    "REGISTRIES",
    "ROUTER_INITS",
    "NoOptions",
    "Registry",
    "component_options",
    "option",
    "option_fields",
    "option_names",
    "option_owner",
]


def option_owner(option: str) -> tuple[Registry, str] | None:
    """The (registry, component name) that accepts the convert option `option`, or None."""
    for registry in REGISTRIES:
        for name, component in registry.items():
            if option in option_names(component):
                return registry, name
    return None


def count_parameters(config, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """(total, active per token) parameters of a checkpoint, exactly from its tensor shapes."""
    import math

    family = FAMILIES[config.model_type]
    total = active = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        total += numel
        active += family.active_parameters(config, name, numel)
    return total, active

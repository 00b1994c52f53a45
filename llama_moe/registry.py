"""The package's extension points, each a registry of components by name (as mergekit registers merge methods).

    conversion.registry    METHODS, ROUTER_INITS, FAMILIES: how a conversion builds experts, routers, the output
    source_families        SOURCE_FAMILIES: the dense architectures a conversion reads (llama, mistral, qwen2, ...)
    export.registry        TARGETS: where `llama-moe export --to` writes a converted model

A component is a class registered under its name, with a one-line `description` and `Options`: a dataclass of the
settings it accepts. Registries whose options are the flags of one command share a `namespace`, in which option
names are unique, because they are CLI flags and recipe keys as they are (`cluster_on` is `--cluster-on` and
`cluster_on:`). The CLI, the recipe files, the model card and `llama-moe info` are generated from the registries, so
adding a component is one module that registers itself:

    @METHODS.register("halves")
    class Halves(SplitMethod):
        description = "Expert e takes every E-th neuron, starting at e."

This module imports nothing heavy: the command line reads the registries before torch is imported.
"""

import dataclasses
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """A component that takes no settings."""


def option(default: Any, help: str, **metadata) -> Any:
    """A component setting: a dataclass field whose `help` (and `choices`, ...) become its CLI flag's."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


class Registry:
    """Name -> component class, for one kind of component. `namespace`: the registries (this one included) whose
    option names must not collide."""

    def __init__(self, kind: str, plural: str, namespace: list | None = None):
        self.kind, self.plural = kind, plural
        self._components: dict[str, type] = {}
        self.namespace = namespace if namespace is not None else []
        self.namespace.append(self)

    def register(self, name: str):
        """Class decorator: register the component under `name` (its `name` attribute is set)."""

        def decorator(component: type) -> type:
            if name in self._components:
                raise ValueError(f"A {self.kind} named {name!r} is registered already.")
            options = getattr(component, "Options", NoOptions)
            if not dataclasses.is_dataclass(options):
                raise TypeError(f"{component.__name__}.Options must be a dataclass.")
            taken = {field: owner for owner, field in option_owners(self.namespace) if field in option_names(component)}
            if taken:
                raise ValueError(f"{self.kind} {name!r}: option names already used by {taken}.")
            component.name = name
            self._components[name] = component
            return component

        return decorator

    def unregister(self, name: str) -> None:
        del self._components[name]

    def __getitem__(self, name: str) -> type:
        if name not in self._components:
            raise ValueError(f"Unknown {self.kind} {name!r}; choose one of {', '.join(self._components)}.")
        return self._components[name]

    def __contains__(self, name: object) -> bool:
        return name in self._components

    def __iter__(self) -> Iterator[str]:
        return iter(self._components)

    def items(self):
        return self._components.items()


def option_fields(component: type) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(getattr(component, "Options", NoOptions))


def option_names(component: type) -> set[str]:
    return {field.name for field in option_fields(component)}


def component_options(component: type, recipe_options: dict):
    """The component's `Options`, filled from a resolved recipe's `options`."""
    return getattr(component, "Options", NoOptions)(**{name: recipe_options[name] for name in option_names(component)})


def option_owners(namespace: list) -> Iterator[tuple[str, str]]:
    """("kind 'name'", option) for every option of every component in the registries of `namespace`."""
    for registry in namespace:
        for name, component in registry.items():
            for field in option_fields(component):
                yield f"{registry.kind} {name!r}", field.name

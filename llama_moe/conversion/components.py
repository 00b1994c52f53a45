"""Imports every built-in component package, so that each component registers itself in `registry`."""

from . import families, methods, routers  # noqa: F401

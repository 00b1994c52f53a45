"""Probes: how `analyze` reads each kind of routed block. A new kind is one module here, registered by name."""

from . import attention, mlp, soap  # noqa: F401  (register the probes)
from .base import PROBES, Probe, Routing, Site, find_sites

__all__ = ["PROBES", "Probe", "Routing", "Site", "find_sites"]

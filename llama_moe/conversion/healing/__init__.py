"""Healing: each MoE MLP of a converted model trained, layer after layer, to reproduce its dense model.

    layer.py    LayerHealer: heals one decoder layer's MoE MLP at a time, carrying the calibration states; its
                settings (HealSettings, the recipe's `heal_*` fields) and its resumable progress (state_dir_for)
    folder.py   heal_folder / HealOptions: `llama-moe heal`, an MoE folder healed into a new folder
    joint.py    heal_jointly: after the layer-wise pass, every layer trained together against the dense model's
                next-token distributions (`--joint-heal-tokens`)

`llama-moe convert --heal-tokens N` heals while converting (`plan.ConversionPlan` drives the LayerHealer); `llama-moe
heal` heals a folder already written. Light to import: `layer` (torch) loads on first use of its names.
"""

from .folder import HealOptions, heal_folder

__all__ = ["STATE_FILE", "HealOptions", "HealSettings", "LayerHealer", "heal_folder", "state_dir_for"]

_LAYER_NAMES = ("STATE_FILE", "HealSettings", "LayerHealer", "state_dir_for")


def __getattr__(name: str):
    if name in _LAYER_NAMES:
        from . import layer

        return getattr(layer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

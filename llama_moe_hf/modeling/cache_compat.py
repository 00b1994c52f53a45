"""The cache argument's name across the supported transformers releases.

transformers 5.24 renamed the cache argument of models, decoder layers, attention and masks, and the cache field of
model outputs, from `past_key_values` to `cache`. The model code follows the new name; `CACHE_ARG` is the name of the
installed release, for calls into transformers' modules and for output fields, so the same code runs on 5.23 too.

This file is copied next to saved checkpoints (remote code): it imports only transformers.
"""

import functools
import warnings

from transformers.cache_utils import Cache
from transformers.modeling_outputs import MoeModelOutputWithPast

CACHE_ARG = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def accepts_past_key_values(forward):
    """`forward(..., cache=...)` that also takes the cache as `past_key_values=` (what transformers < 5.24 passes).
    On 5.24 and later the old name is deprecated, with the warning transformers' own models give for it."""

    @functools.wraps(forward)
    def wrapper(*args, past_key_values: Cache | None = None, **kwargs):
        if past_key_values is not None and kwargs.get("cache") is None:
            if CACHE_ARG == "cache":
                message = f"`past_key_values` is deprecated for `{forward.__qualname__}`. Use `cache` instead."
                warnings.warn(message, FutureWarning, stacklevel=2)
            kwargs["cache"] = past_key_values
        return forward(*args, **kwargs)

    return wrapper


def output_cache(outputs) -> Cache | None:
    """The cache a model output carries, whichever name the installed transformers gives the field."""
    return outputs.get(CACHE_ARG)

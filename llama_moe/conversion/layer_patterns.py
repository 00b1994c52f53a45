"""Which decoder layers get experts: `--moe-layers` patterns.

Terms, separated by commas or spaces (or a list of terms), their union is taken: `5` (one layer), `0-7` (inclusive
range), `first:N`, `last:N`, `every:K` (0, K, 2K, ...), `every:K:OFFSET` (OFFSET, OFFSET + K, ...), `all`. Negative
indices are not accepted; use `last:N`. No pattern (None) means every layer.
"""

import re

_LAYER_TERM = re.compile(r"(all)|(\d+)|(\d+)-(\d+)|(first|last):(\d+)|every:(\d+)(?::(\d+))?")


def layer_terms(spec: str | list[str] | None) -> list[tuple[str, re.Match]]:
    """(term, match) for each term of a pattern; one ValueError for a badly written term (no layer count needed)."""
    parts = [] if spec is None else spec if isinstance(spec, list) else [spec]
    # commas or spaces between terms: '0 2 5' is three layers (it once read as layer 25)
    terms = [term for part in parts for term in re.split(r"[,\s]+", str(part)) if term]
    matches = []
    for term in terms:
        match = _LAYER_TERM.fullmatch(term)
        if match is None:
            raise ValueError(
                f"Cannot read the layer pattern term {term!r}; use e.g. '0,2,5', '0-7', 'last:2', 'first:4', "
                "'every:2', 'every:2:1' or 'all'."
            )
        matches.append((term, match))
    return matches


def parse_moe_layers(spec: str | list[str] | None, num_layers: int) -> list[int]:
    """The sorted layer indices a pattern selects in a model of `num_layers` layers."""
    if spec is None:
        return list(range(num_layers))
    layers: set[int] = set()
    for term, match in layer_terms(spec):
        layers.update(_term_layers(term, match, num_layers))
    bad = sorted(i for i in layers if i >= num_layers)
    if bad:
        raise ValueError(f"Layer pattern {spec!r} names layers {bad}, but the model has layers 0..{num_layers - 1}.")
    if not layers:
        raise ValueError(f"Layer pattern {spec!r} selects no layer.")
    return sorted(layers)


def _term_layers(term: str, match: re.Match, num_layers: int):
    everything, single, lo, hi, side, count, step, offset = match.groups()
    if everything:
        return range(num_layers)
    if single is not None:
        return [int(single)]
    if lo is not None:
        if int(lo) > int(hi):
            raise ValueError(f"Layer range {term!r} is empty (start after end).")
        return range(int(lo), int(hi) + 1)
    if side is not None:
        if not 1 <= int(count) <= num_layers:
            raise ValueError(f"Layer pattern {term!r}: the model has {num_layers} layers.")
        return range(int(count)) if side == "first" else range(num_layers - int(count), num_layers)
    if int(step) < 1:
        raise ValueError(f"Layer pattern {term!r}: the step must be at least 1.")
    return range(int(offset or 0), num_layers, int(step))

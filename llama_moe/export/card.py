"""The model card's "Serving" section: which export targets express a converted model exactly, and why not the rest.

`llama-moe convert` passes `serving_section` to the conversion (`convert(..., card_sections=...)`), which writes it
into the card; the conversion itself does not import the export targets (they sit a floor above it).
"""

from . import TARGETS


def serving_section(config) -> str:
    """Markdown: one row per exact export target (the `dense` merge is not exact and is left out), with the command
    or the first reason the target gives."""
    rows = []
    for name, target in TARGETS.items():
        if not getattr(target, "exact", True):
            continue
        reasons = target.supports(config)
        how = f"exact: `llama-moe export MODEL --to {name} --output DIR`" if not reasons else f"no: {reasons[0]}"
        rows.append(f"| `{name}` | {how} |")
    exact = [name for name, target in TARGETS.items() if getattr(target, "exact", True) and not target.supports(config)]
    summary = f"Exports exactly to {', '.join(exact)}." if exact else "No export target expresses this model exactly."
    return "\n".join(["## Serving", "", summary, "", "| target | |", "|---|---|", *rows, ""])

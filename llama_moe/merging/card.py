"""The model card of a merged checkpoint: every source with its revision, the gate and its prompts or data, the
settings table of the family, the merge recipe, parameter counts, and the Usage section every card shares."""

from pathlib import Path

from ..hub.card import PROJECT_URL, REFERENCES, TAGS, has_tokenizer, public, usage_section

MERGE_REFERENCES = (
    "- mergekit-moe (Goddard et al., mergekit, 2024): the merge layout and gate modes.\n"
    "- Branch-Train-MiX: Mixing Expert LLMs into a Mixture-of-Experts LLM (Sukhbaatar et al., 2024), arXiv:2403.07816."
)


def render_merge_card(plan, source, total: int, active: int, quality=None, tokenizer: bool = True) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    from ..conversion.conversion_card import human_count, quality_section
    from ..conversion.recipe import to_yaml
    from .config import MERGE_RECIPE_FILE

    merge = plan.config.conversion_info["merge"]
    model_id = plan.run.repo_id or Path(plan.run.output).name
    base = source.base.hub_id
    gate = plan.components["mlp"][1]
    rows = plan.family.card_rows(plan.config, plan) + [("Non-FFN weights", _non_ffn_text(merge["non_ffn"]))]
    body = f"""
# {Path(model_id).name}

A Mixture-of-Experts model merged with [llama-moe-hf]({PROJECT_URL}) from {len(merge["experts"])} models of one
architecture: attention, norms and embeddings from the base `{public(merge["base_model"])}`, each model's FFN as
{plan.merge.experts_per_model} routed expert(s). The router was initialised `{gate.name}` ({gate.description}) and
not trained: train it (`recipes/pretrain/btx-mix.yaml`) before judging the routing.
{quality_section(quality)}
## Sources

| Experts | Model | Revision | Prompts or data |
|---|---|---|---|
{_source_rows(merge, plan.merge.experts_per_model)}

## Merge

| Setting | Value |
|---|---|
{chr(10).join(f"| {name} | {value} |" for name, value in rows)}

Merged from this recipe (`{MERGE_RECIPE_FILE}` in this repository; `llama-moe merge --config {MERGE_RECIPE_FILE}
--output DIR` merges the same weights again):

```yaml
{to_yaml(_public_merge(plan.merge.to_dict()))}```

## Parameters

| | Parameters |
|---|---|
| Total | {total:,} ({human_count(total)}) |
| Active per token | {active:,} ({human_count(active)}) |

{usage_section(model_id, tokenizer=tokenizer, source=base)}

## References

{MERGE_REFERENCES}
{REFERENCES}
"""
    metadata = ModelCardData(
        base_model=base,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=plan.run.license or source.license,
        tags=[*TAGS, "merge", "moe-merge", f"gate-{gate.name}"],
    )
    return str(ModelCard(f"---\n{metadata.to_yaml()}\n---\n{body}"))


def _source_rows(merge: dict, per_model: int) -> str:
    rows = []
    for index, entry in enumerate(merge["experts"]):
        first = index * per_model
        experts = str(first) if per_model == 1 else f"{first}-{first + per_model - 1}"
        rows.append(
            f"| {experts} | `{public(entry['source_model'])}` | {entry['revision'] or '-'} | {_inputs(entry)} |"
        )
    for entry in merge["shared_experts"]:
        scale = f" (residual scale {entry['residual_scale']})" if entry["residual_scale"] != 1.0 else ""
        rows.append(f"| shared{scale} | `{public(entry['source_model'])}` | {entry['revision'] or '-'} | always on |")
    return "\n".join(rows)


def _inputs(entry: dict) -> str:
    parts = []
    for key, sign in (("positive_prompts", "+"), ("negative_prompts", "-")):
        parts += [f"{sign} {prompt!r}" for prompt in entry.get(key, [])]
    if entry.get("data"):
        parts.append(f"data `{public(entry['data'])}`")
    return "<br>".join(parts) or "-"


def _non_ffn_text(non_ffn: str) -> str:
    return "the base model's" if non_ffn == "base" else "the average over the base and the expert models"


def _public_merge(fields: dict) -> dict:
    fields = {key: public(value) for key, value in fields.items()}
    for key in ("experts", "shared_experts"):
        fields[key] = [{**entry, "source_model": public(entry["source_model"])} for entry in fields[key]]
    return fields


def write_merge_card(folder: Path, plan, source, total: int, active: int, quality=None) -> Path:
    path = Path(folder) / "README.md"
    path.write_text(render_merge_card(plan, source, total, active, quality, has_tokenizer(folder)), encoding="utf-8")
    return path

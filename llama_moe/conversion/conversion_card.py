"""The conversion's model card (README.md of a converted checkpoint): Hub metadata, the settings table (from the
family and its components), the recipe it was built from, parameter counts; the parts every card shares (tags, the
Usage section, public names) are `hub.card`'s. Here, not in `hub`: it reads the plan and the recipe (conversion)."""

from pathlib import Path

from ..hub.card import (
    PROJECT_URL,
    REFERENCES,
    TAGS,
    absolute_doc_links,
    has_tokenizer,
    public,
    public_recipe,
    usage_section,
)
from .target import MLP


def human_count(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def render_model_card(
    plan, source, total: int, active: int, quality=None, tokenizer: bool = True, extra: str = ""
) -> str:
    """The README.md text of the checkpoint `plan` builds from `source` (`tokenizer`: whether it has tokenizer
    files; `extra`: markdown sections from the caller, after the parameters)."""
    from huggingface_hub import ModelCard

    from .recipe import RECIPE_FILE, to_yaml

    model_id = plan.run.repo_id or Path(plan.run.output).name  # never a local path: `push` names the repository
    base_model = plan.run.base_model or source.hub_id
    notes = " ".join(method.card_note() for method, _ in plan.components.values())
    base_text = (
        f"[{base_model}](https://huggingface.co/{base_model})" if base_model else f"`{public(source.description)}`"
    )
    body = f"""
# {Path(model_id).name}

A Mixture-of-Experts model converted from the dense {base_text} with
[llama-moe-hf]({PROJECT_URL}) (LLaMA-MoE-style expert construction).

{training_note(plan, notes)}
{quality_section(quality)}
## Conversion

| Setting | Value |
|---|---|
{_settings_rows(plan, source)}

Built from this recipe (`{RECIPE_FILE}` in this repository; `llama-moe convert --config {RECIPE_FILE} --output DIR`
builds the same weights again):

```yaml
{to_yaml(public_recipe(plan.asked.to_dict()))}```

## Parameters

| | Parameters |
|---|---|
| Total | {total:,} ({human_count(total)}) |
| Active per token | {active:,} ({human_count(active)}) |

Active parameters count everything a token uses: embeddings, attention, norms, routers, shared experts and the
routed experts it is sent to. Computed exactly from the tensor shapes.

{extra}
{usage_section(model_id, tokenizer=tokenizer, source=base_model)}

## References

{REFERENCES}
"""
    return str(ModelCard(f"---\n{_metadata(plan, source, base_model).to_yaml()}\n---\n{body}"))


def _metadata(plan, source, base_model):
    from huggingface_hub import ModelCardData

    methods = [method.name for method, _ in plan.components.values()]
    return ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=plan.run.license or source.license,
        tags=TAGS + [f"moe-{name}" for name in methods] + [plan.family.name.replace("_", "-")],
    )


def _settings_rows(plan, source) -> str:
    """The family's rows (from its registered components), then what every conversion records."""
    settings = plan.family.card_rows(plan.config, plan) + [
        ("Seed", plan.recipe.seed),
        ("Weights dtype", str(plan.config.dtype).replace("torch.", "")),
        ("Source", f"`{public(source.description)}`"),
        ("Source family", _source_family_text(plan.config)),
    ]
    joint = (plan.config.conversion_info or {}).get("joint_healing")
    if joint:
        text = "{tokens:,} calibration tokens, next-token KL to the dense model {kl_first_steps} -> {kl_last_steps}"
        if "held_out_kl_before" in joint:
            text = (
                "{tokens:,} calibration tokens, KL weight {kl_weight}, next-token KL to the dense model on held-back "
            )
            text += "text {held_out_kl_before} -> {held_out_kl_after}"
        settings.append(("All layers healed jointly", text.format(**joint)))
    return "\n".join(f"| {name} | {value} |" for name, value in settings)


def _source_family_text(config) -> str:
    """The source family, with what of its attention the model keeps (its transformers modules, as they are)."""
    from ..source_families import SOURCE_FAMILIES

    family = SOURCE_FAMILIES[config.source_model_type]
    kept = f"attention, norms and RoPE are transformers' own {family.name} modules"
    return f"`{family.name}`: {family.description} ({kept})"


def training_note(plan, notes: str) -> str:
    """Whether the weights were trained after the conversion (healing), on what and how much, and a joint stage left
    to a training run; else the methods' notes on what to expect of an untrained conversion."""
    recipe, info = plan.recipe, plan.config.conversion_info or {}
    joint, left = info.get("joint_healing"), _deferred_note(info.get("joint_healing_deferred"))
    if not recipe.heal_tokens and not joint:
        return f"This checkpoint was converted, not trained. {notes}{left}"
    stages = []
    if recipe.heal_tokens:
        passes = f"{recipe.heal_epochs} pass{'es' if recipe.heal_epochs > 1 else ''}"
        stages.append(
            f"each MoE layer in turn on {recipe.heal_tokens:,} tokens ({passes}), router and experts "
            f"together, to reproduce the dense model's {'hidden states' if recipe.heal_target == 'stream' else 'MLP'}"
        )
    if joint:
        held = joint.get("held_out_kl_before")
        change = f"; KL to the dense model on held-back text {held} -> {joint['held_out_kl_after']}" if held else ""
        weight = joint.get("kl_weight", 0.5)
        loss = "the KL alone" if weight == 1 else f"the KL at weight {weight}, the text's own loss at {1 - weight:g}"
        stages.append(
            f"then every layer together on {joint['tokens']:,} tokens towards the dense model's next-token "
            f"distributions ({loss}{change})"
        )
    _, router = plan.components[MLP] if MLP in plan.components else next(iter(plan.components.values()))
    return (
        f"Healed after conversion, towards its dense source: {'; '.join(stages)}. Training text: "
        f"{public(info.get('calibration_data', 'the calibration data'))}. The routers were initialised `{router.name}` "
        f"and trained in healing.{left}"
    )


def _deferred_note(deferred: dict | None) -> str:
    if not deferred:
        return ""
    return (
        f" The joint stage ({deferred['tokens']:,} tokens, every layer together) was left to a training run, not run "
        f"in the conversion: its text is `{deferred['text']}`, and `llama-moe convert` printed the command that runs it."
    )


def quality_section(quality) -> str:
    """What the conversion's quick check measured (`quick_check.QuickCheck`), if it ran."""
    if quality is None:
        return ""
    lines = "\n".join(f"- {line}" for line in quality.lines())
    return absolute_doc_links(f"""
**Measured after conversion** against the dense model, on nothing it was calibrated on:

{lines}

`llama-moe eval` measures more (other text, lm-eval tasks); the presets' measurements: docs/quality.md.
""")


def write_model_card(folder: Path, plan, source, total: int, active: int, quality=None, extra: str = "") -> Path:
    path = Path(folder) / "README.md"
    text = render_model_card(plan, source, total, active, quality, tokenizer=has_tokenizer(folder), extra=extra)
    path.write_text(text, encoding="utf-8")
    return path

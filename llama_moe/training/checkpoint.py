"""A trained model as a complete checkpoint: weights (normal permissions), config, remote code, tokenizer, the
training history of every stage so far, and a model card that states it; written atomically.

`training_history.json` lists one record per stage (recipe, data, steps, tokens, schedule, results). A stage that
starts from a checkpoint with a history extends it, so the card of stage 2 states stage 1 as well. The conversion
recipe (`moe_recipe.yaml`) is carried forward too: the card's origin section names it, and it records the dense
source, the default distillation teacher.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

HISTORY_FILE = "training_history.json"
LOG_FILE = "trainer_log.json"  # this stage's log lines (losses, evaluations, domain weights), for plots
ORIGIN_HEADING = "## The model training started from"


@dataclass
class TrainingOutcome:
    model: object  # the trained model, as it was saved
    metrics: dict  # held-out results (pre-training) or the trainer's final metrics (SFT)
    output: Path  # the checkpoint folder
    log_history: list[dict]  # the trainer's log lines (losses, router loss, domain weights)


def unwrapped(trainer):
    """The trained model without the trainer's wrappers (DDP, and the mixed-precision autocast around `forward`)."""
    return trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)


def read_history(model_path: str) -> list[dict]:
    path = Path(model_path) / HISTORY_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def save_complete_checkpoint(
    trainer, tokenizer, output_dir: str, source: str, record: dict, extra: dict[str, Path] | None = None
) -> Path:
    """Save `trainer.model` with everything needed to load and understand it into `output_dir`, atomically.

    Every process calls this: sharded models gather their weights in `save_model`, into a staging folder all ranks
    name alike. The main process then completes it as `atomic_folder`'s temporary folder, which is swapped in with
    normal permissions. The trainer's intermediate checkpoints already in `output_dir` move into the new folder as its
    last step, as do the `extra` folders (name in the output: folder the main process wrote, e.g. a LoRA adapter)."""
    from ..checkpoints.atomic import atomic_folder

    output = Path(output_dir).resolve()
    staging = output.with_name(f".{output.name}.staging")
    main = trainer.is_world_process_zero()
    if main:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    try:
        trainer.save_model(str(staging))
        if main:
            with atomic_folder(output, staging=staging, last=lambda tmp: _move_in(tmp, output, extra)) as tmp:
                (tmp / "training_args.bin").unlink(missing_ok=True)  # a pickle; the history records the arguments
                tokenizer.save_pretrained(tmp)
                write_training_record(tmp, output.name, source, record)
                (tmp / LOG_FILE).write_text(json.dumps(trainer.state.log_history, indent=1) + "\n")
    finally:
        if main:
            shutil.rmtree(staging, ignore_errors=True)
            for folder in (extra or {}).values():
                shutil.rmtree(folder, ignore_errors=True)
            if output.is_dir() and not any(output.iterdir()):  # made by the Trainer, never filled: the run failed
                output.rmdir()
    trainer.accelerator.wait_for_everyone()
    return output


def _move_in(tmp: Path, output: Path, extra: dict[str, Path] | None) -> None:
    """The `extra` folders and the trainer's checkpoints into the finished folder, as they are, as the last step before
    it is swapped in (they are not walked again)."""
    for name, folder in (extra or {}).items():
        Path(folder).rename(tmp / name)
    for entry in output.glob("checkpoint-*") if output.is_dir() else []:
        entry.rename(tmp / entry.name)


def write_training_record(folder: Path, name: str, source: str, record: dict) -> None:
    """Into `folder`: the training history (the source's, extended by this stage's `record`), the conversion recipe
    the source carries, and the card of the model `name`."""
    from ..conversion.recipe import RECIPE_FILE

    if (Path(source) / RECIPE_FILE).is_file():
        shutil.copyfile(Path(source) / RECIPE_FILE, folder / RECIPE_FILE)
    history = read_history(source) + [record]
    (folder / HISTORY_FILE).write_text(json.dumps(history, indent=2) + "\n")
    (folder / "README.md").write_text(render_training_card(name, source, history), encoding="utf-8")


def render_training_card(name: str, source: str, history: list[dict]) -> str:
    """README.md: the training stages, their results, usage, and what the first stage started from."""
    from huggingface_hub import ModelCard, ModelCardData

    from ..hub.card import PROJECT_URL, TAGS, usage_section

    source_card = Path(source) / "README.md"
    base = ModelCard.load(source_card) if source_card.is_file() else None
    kinds = sorted({stage["recipe"].replace(" ", "-") for stage in history})  # Hub tags have no spaces ("trl sft")
    metadata = ModelCardData(
        base_model=getattr(base.data, "base_model", None) if base else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=TAGS + kinds,
    )
    rows = "\n".join(_stage_row(i + 1, stage) for i, stage in enumerate(history))
    results = "\n".join(_results(i + 1, stage) for i, stage in enumerate(history) if stage.get("results"))
    distilled = [
        _distillation(i + 1, stage["distillation"]) for i, stage in enumerate(history) if stage.get("distillation")
    ]
    distilled += [_lora(i + 1, stage["lora"]) for i, stage in enumerate(history) if stage.get("lora")]
    body = f"""
# {name}

A Mixture-of-Experts model trained with [llama-moe-hf]({PROJECT_URL}) recipes
after conversion. The full record of every stage is `{HISTORY_FILE}` in this repository.

## Training

| Stage | Recipe | Data | Steps | Tokens / examples | Learning rate | Processes |
|---|---|---|---|---|---|---|
{rows}
{"".join(distilled)}
{results}

{usage_section(name)}

{ORIGIN_HEADING}

{_origin(base, source)}
"""
    return str(ModelCard(f"---\n{metadata.to_yaml()}\n---\n{body}"))


def _origin(base, source: str) -> str:
    """What stage 1 started from: a trained source's own origin section, or a converted source's conversion and
    parameter sections (its usage section names the source folder, so it stays out)."""
    if base is None:
        return f"`{Path(source).name}`"
    text = base.text
    if ORIGIN_HEADING in text:
        return text.split(ORIGIN_HEADING, 1)[1].strip()
    start, end = text.find("## Conversion"), text.find("## Usage")
    return text[start:end].strip() if 0 <= start < end else text.split("\n", 2)[-1].strip()


def _stage_row(number: int, stage: dict) -> str:
    data = ", ".join(name if share is None else f"{name} ({share:.0%})" for name, share in stage["data"].items())
    if "sampling" in stage:
        data += f"; {stage['sampling']} sampling"
    amount = f"{stage['tokens']:,} tokens" if "tokens" in stage else f"{stage.get('examples', 0):,} examples"
    kwargs = ", ".join(f"{name} {value}" for name, value in stage.get("lr_scheduler_kwargs", {}).items())
    scheduler = f"{stage['lr_scheduler_type']} ({kwargs})" if kwargs else stage["lr_scheduler_type"]
    schedule = f"{stage['learning_rate']:g}, {scheduler}, warm-up {stage['warmup']:g}"
    return (
        f"| {number} | {stage['recipe']} | {data} | {stage['steps']} | {amount} | {schedule} | {stage['world_size']} |"
    )


def _distillation(number: int, settings: dict) -> str:
    details = ", ".join(f"{name} {value}" for name, value in settings.items() if name != "teacher")
    return f"\nStage {number} distilled from `{settings['teacher']}` ({details}).\n"


def _lora(number: int, settings: dict) -> str:
    full = f"; trained in full: {', '.join(settings['trained_in_full'])}" if settings["trained_in_full"] else ""
    return (
        f"\nStage {number} trained LoRA adapters (r {settings['r']}, alpha {settings['alpha']}, on "
        f"{', '.join(settings['targets'])}{full}), merged into the weights; that stage's output kept the adapter "
        "in `adapter/`.\n"
    )


def _results(number: int, stage: dict) -> str:
    lines = [f"Stage {number} results (held-out):", ""]
    lines += [f"- {name}: {value}" for name, value in stage["results"].items()]
    return "\n".join(lines) + "\n"


def stage_record(trainer, recipe: str, data: dict[str, float], source: str, **extra) -> dict:
    """What a stage did, for `training_history.json` and the card: `data` maps each dataset or domain to its share."""
    args = trainer.args
    return {
        "recipe": recipe,
        "started_from": Path(source).name,  # a name, never a local path: the card may be published
        "data": data,
        "steps": trainer.state.global_step,
        "learning_rate": args.learning_rate,
        "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "lr_scheduler_kwargs": dict(args.lr_scheduler_kwargs or {}),  # e.g. min_lr_rate: where the decay ends
        "warmup": args.warmup_steps,  # steps, or a ratio of them when < 1
        "world_size": args.world_size,
        **extra,
    }

"""Streaming conversion: a dense checkpoint on disk -> an MoE checkpoint folder, one decoder layer at a time.

    recipe + run options -> resolve (before the source is opened) -> open the source -> plan -> calibration context
        -> every calibration pass, then the dense model is freed -> tensors streamed into shards -> config, code,
        tokenizer -> [every layer healed jointly against the dense model, the weights written again] -> recipe ->
        quick check against the dense model (answers, other-domain text) -> card -> the temporary folder replaces
        the output

A failed or interrupted conversion leaves nothing behind and never touches its source.
"""

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..devices import default_device
from ..preflight import check_writable
from .recipe import RECIPE_FILE, MoERecipe, save_recipe
from .registry import count_parameters
from .settings import RunOptions

logger = logging.getLogger(__name__)


@dataclass
class ConversionResult:
    """What a conversion wrote."""

    output_dir: Path
    total_parameters: int
    active_parameters: int
    files: list[str] = field(default_factory=list)
    recipe: MoERecipe | None = None  # the resolved recipe (every default filled in)
    pushed: str | None = None  # the Hub commit URL, with `push_to_hub`
    quality: object | None = None  # `quick_check.QuickCheck`: what it kept of the dense model (`eval`)
    next_command: str | None = None  # the joint stage as a training run, where it was left to one


def convert(recipe: MoERecipe, run: RunOptions, *, download=None, hub_api=None, card_sections=None) -> ConversionResult:
    """Convert the dense checkpoint `run.model` into the MoE checkpoint folder `run.output`, as `recipe` says.

    `download` fetches Hub repositories (default `huggingface_hub.snapshot_download`) and `hub_api` uploads with
    `run.push_to_hub` (default `HfApi`): the seams tests replace. `card_sections(config)` gives markdown the card
    adds (the CLI's: `export.card.serving_section`, which export targets take the model).
    """
    import torch

    from ..checkpoints import open_source
    from .calibration import CalibrationContext
    from .plan import ConversionPlan, resolve_recipe

    run.check()  # before the output is checked, as the run's own settings always were
    output = check_output(run)
    if run.save_split:
        check_writable(run.save_split, "--save-split")
    resolved = resolve_recipe(recipe, run=run)  # what needs no source is refused before opening (or downloading) it
    if run.push_to_hub and not run.repo_id:
        raise ValueError("--push-to-hub needs --repo-id ORG/NAME.")
    source = open_source(
        run.model,
        allow_pickle=run.allow_pickle,
        revision=run.revision,
        token=run.token,
        tokenizer=run.tokenizer,
        **({"download": download} if download else {}),
    )
    check_not_source(output, source)
    source.check_complete()
    plan = ConversionPlan.create(recipe, source.config, run, resolved=resolved)
    context = CalibrationContext(
        plan.recipe,
        source.load_model,
        source.load_tokenizer,
        device=run.device,
        batch_size=run.calibration_batch_size,
        progress=run.progress,
        source=source,
        offload_dir=run.offload_dir,
    )
    plan.request(context)
    check_memory(plan, run, source.dtype, context.requested)
    plan.prepare(context)
    context.release()  # the write streams: about one decoder layer in memory
    if context.text_seconds:  # made during the calibration and on release: a stage of its own
        plan.stage_seconds["text"] = round(context.text_seconds, 1)
    plan.config.dtype = getattr(torch, run.dtype) if run.dtype else source.dtype
    result = _write(plan, source, context, output, card_sections)
    log_stage_times(plan)
    if plan.joint_deferred:
        result.next_command = say_deferred(plan, output)
    if plan.heal_state_dir is not None:  # written: the healing progress kept for a resume is no longer needed
        shutil.rmtree(plan.heal_state_dir, ignore_errors=True)
    if run.push_to_hub:
        from ..hub.push import push_folder

        result.pushed = push_folder(output, run.repo_id, private=run.private, token=run.token, api=hub_api)
    return result


def check_memory(plan, run: RunOptions, source_dtype, requested: bool = True) -> None:
    """The memory, disk and time forecast of each stage (`forecast.py`), before any weight is read: one ValueError
    where a stage will not fit, unless `run.force`; logged (for a run of a few seconds only at debug level), and kept
    in `conversion_info`. `requested`: the components asked for calibration statistics (`plan.request`)."""
    import torch

    from ..footprint import GIB, available_bytes
    from .forecast import check_forecast, forecast, report, seconds

    available = available_bytes("cpu")
    dtype = getattr(torch, run.dtype) if run.dtype else source_dtype
    stages = defer_joint_stage(plan, forecast(plan, available, dtype.itemsize, requested), available)
    check_forecast(stages, available, run.force)
    rate = report(stages, available, run.device or default_device(), plan.dense_config)
    plan.forecast = {
        "memory_gib": {stage.name: round(stage.peak / GIB, 2) for stage in stages},
        "disk_gib": {stage.name: round(stage.disk / GIB, 3) for stage in stages if stage.disk},
    }
    plan.expected_seconds = {stage.name: seconds(stage, rate) for stage in stages if stage.flops}
    plan.expected_seconds["matmul GFLOP/s"] = rate / 1e9


def defer_joint_stage(plan, stages: list, available: float) -> list:
    """The stages this process runs: without the joint stage where `--defer-joint-heal` asks, or where it needs more
    memory than is free (unless `--force`); `plan.joint_deferred` is then that stage's forecast."""
    from ..footprint import GIB, HEADROOM

    joint = next((stage for stage in stages if stage.name == "joint heal"), None)
    too_large = joint is not None and joint.peak > HEADROOM * available and not plan.run.force
    if joint is None or not (plan.run.defer_joint_heal or too_large):
        return stages
    if too_large:
        logger.warning(
            "The joint heal stage needs about %.1f GiB and %.1f GiB is free: this conversion writes the layer-wise "
            "result and its text, and ends with the command that runs the stage where it fits (--force runs it "
            "here).",
            joint.peak / GIB,
            available / GIB,
        )
    plan.joint_deferred = joint
    return [stage for stage in stages if stage is not joint]


def say_deferred(plan, output: Path) -> str:
    """The command that runs the joint stage left to a training run, logged; returns it."""
    from ..footprint import GIB
    from .healing.joint import JOINT_TEXT, recipe_command

    deferred = plan.config.conversion_info["joint_healing_deferred"]
    command = recipe_command(output, output / JOINT_TEXT, plan.recipe, deferred["sequences"])
    logger.warning(
        "The joint heal stage was not run here (about %.1f GiB). Run it, from the repository's root on a machine "
        "where it fits (accelerate launch shards it over GPUs, docs/scale_out.md; add --use_cpu true without one):"
        "\n  %s",
        plan.joint_deferred.peak / GIB,
        command,
    )
    return command


def log_stage_times(plan) -> None:
    """One line at the end: each stage's time, and in brackets what the forecast expected."""
    expected = plan.expected_seconds
    shown = [
        f"{name} {took:.1f}" + (f" ({expected[name]:.1f})" if name in expected else "")
        for name, took in plan.stage_seconds.items()
    ]
    from .forecast import SAY_SECONDS

    rate = expected.get("matmul GFLOP/s")
    level = logging.INFO if sum(plan.stage_seconds.values()) >= SAY_SECONDS else logging.DEBUG
    rate = f"; matmul {rate:.1f} GFLOP/s" if rate else ""
    logger.log(level, "Stage times (s; forecast in brackets): %s%s.", ", ".join(shown), rate)


def write_checkpoint(plan, source, context, folder: Path, info: dict | None = None) -> tuple[int, int]:
    """Into `folder`: the weights, streamed a decoder layer at a time; the config with `conversion_info` (what the
    layers reported, and `info`); the modeling code; the source's tokenizer files. Returns (total, active)
    parameters."""
    from transformers.dynamic_module_utils import custom_object_save

    from ..checkpoints.writer import ShardedWriter

    start = time.perf_counter()
    writer = ShardedWriter(folder, plan.expected, plan.config.dtype, plan.run.max_shard_size)
    for name, tensor in plan.tensors(source, context, progress=plan.run.progress):
        writer.add(name, tensor)
    total, active = count_parameters(plan.config, writer.shapes)
    writer.close(total_parameters=total)
    plan.stage_seconds["layer heal" if plan.healer else "write"] = round(time.perf_counter() - start, 1)
    plan.config.conversion_info = plan.conversion_info(source.description, context) | (info or {})
    plan.meta_model.add_auto_map()  # every head of the family, not only the causal LM
    custom_object_save(plan.meta_model, folder, config=plan.config)  # the modeling code next to the weights
    plan.config.save_pretrained(folder)
    source.save_extras(folder)
    return total, active


def _write(plan, source, context, output: Path, card_sections=None) -> ConversionResult:
    from ..checkpoints.atomic import atomic_folder
    from .conversion_card import write_model_card

    run = plan.run
    with atomic_folder(output) as tmp:
        total, active = write_checkpoint(plan, source, context, tmp)
        context.drop_statistics()
        if plan.recipe.joint_heal_tokens:
            (write_deferred if plan.joint_deferred else heal_written_jointly)(plan, source, context, tmp)
        reproduce = dataclasses.replace(run, model=source.reference, tokenizer=source.tokenizer_source)
        save_recipe(tmp / RECIPE_FILE, plan.asked, reproduce)
        quality = quality_check(tmp, source, run, total)
        extra = card_sections(plan.config) if card_sections else ""
        write_model_card(tmp, plan, source, total, active, quality, extra)
        files = sorted(p.name for p in tmp.iterdir())
    return ConversionResult(output, total, active, files, plan.recipe, quality=quality)


def heal_written_jointly(plan, source, context, folder: Path) -> None:
    """`--joint-heal-tokens`: the written folder trained as a whole against the dense model (`healing.joint`); its
    config records what that did (`conversion_info["joint_healing"]`)."""
    import torch

    from .healing.joint import heal_folder_jointly, joint_heal_tokens

    recipe, run = plan.recipe, plan.run
    device, start = run.device or default_device(), time.perf_counter()
    info = heal_folder_jointly(
        folder,
        source.load_model(torch.float32, device),
        joint_heal_tokens(context, recipe),
        recipe.joint_heal_lr,
        dtype=plan.config.dtype,
        max_shard_size=run.max_shard_size,
        device=device,
        progress=run.progress,
        kl_weight=recipe.joint_heal_kl_weight,
    )
    plan.stage_seconds["joint heal"] = round(time.perf_counter() - start, 1)
    plan.config.conversion_info = {**plan.config.conversion_info, "joint_healing": info}
    plan.config.save_pretrained(folder)


def write_deferred(plan, source, context, folder: Path) -> None:
    """The joint stage's tokens, as text for the training recipe that runs it (`healing.joint.write_joint_text`);
    the config records it (`conversion_info["joint_healing_deferred"]`)."""
    from .healing.joint import JOINT_TEXT, joint_heal_tokens, write_joint_text

    tokens = joint_heal_tokens(context, plan.recipe)
    documents = write_joint_text(folder / JOINT_TEXT, tokens, source.load_tokenizer())
    deferred = {"tokens": tokens.numel(), "sequences": len(tokens), "documents": documents, "text": JOINT_TEXT}
    plan.config.conversion_info = {**plan.config.conversion_info, "joint_healing_deferred": deferred}
    plan.config.save_pretrained(folder)


def quality_check(folder: Path, source, run: RunOptions, total: int):
    """`quick_check.quick_check` of the written folder against its source, unless `eval` is off, the model is too
    large for a quick check, or the source has no tokenizer (each logged)."""
    if not run.eval:
        return None
    return run_quick_check(folder, source.load_model, source.load_tokenizer, total, run.device, run.progress)


def run_quick_check(
    folder: Path, load_dense, load_tokenizer, total: int, device=None, progress=True, reference="the dense model"
):
    """The quick check with its log lines (convert, merge and export share it); None where the model is too large or
    the source has no tokenizer."""
    from .calibration import transformers_progress_bars
    from .quick_check import MAX_PARAMETERS, TEXT_DESCRIPTION, quick_check

    if total > MAX_PARAMETERS:
        logger.info("Quick check skipped (%s parameters): run `llama-moe eval` on the output.", f"{total:,}")
        return None
    try:
        tokenizer = load_tokenizer()
    except (OSError, ValueError) as error:
        logger.info("Quick check skipped: the source has no tokenizer (%s).", error)
        return None
    logger.info(
        "Checking the result against %s: its answers to chat prompts, and %s (--no-eval skips this)...",
        reference,
        TEXT_DESCRIPTION,
    )
    with transformers_progress_bars(progress):
        check = quick_check(folder, load_dense, tokenizer, device=device, reference=reference)
    for line in check.lines():
        (logger.warning if line.startswith("warning") else logger.info)("%s", line)
    return check


def convert_to_moe(model=None, output_dir=None, recipe: MoERecipe | None = None, **fields) -> ConversionResult:
    """`convert` with keyword arguments: recipe fields, component options and run options by name.

        convert_to_moe(None, "smollm2-moe", method="upcycle", num_experts=8, top_k=2, dtype="bfloat16")
        convert_to_moe("path/to/llama", "out", recipe, overwrite=True)   # fields override the recipe

    `model`: a local folder, a Hub repository id, a `.gguf` file, or None for the built-in SmolLM2-135M-Instruct.
    """
    seams = {key: fields.pop(key) for key in ("download", "hub_api", "card_sections") if key in fields}
    recipe, run_fields = (recipe or MoERecipe()).with_fields(fields)
    run = RunOptions(model=None if model is None else str(model), output=output_dir and str(output_dir), **run_fields)
    return convert(recipe, run, **seams)


def check_output(run: RunOptions) -> Path:
    if not run.output:
        raise ValueError("A conversion needs an output folder (--output, output_dir=).")
    output = Path(run.output).expanduser().resolve()
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"Output {output} exists and is not a folder.")
    if output.exists() and not run.overwrite:
        raise FileExistsError(
            f"Output folder {output} already exists; pass --overwrite (overwrite=True) to replace it."
        )
    check_writable(output, "--output")  # now, not after the model is loaded and calibrated
    return output


def check_not_source(output: Path, source) -> None:
    source_path = source.path.resolve()
    if output == source_path or output in source_path.parents:
        raise ValueError(f"Output {output} would replace the source {source.path}; choose another output folder.")

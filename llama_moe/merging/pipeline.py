"""`merge`: a base model and N expert models of one source family -> one MoE checkpoint folder, streamed a layer at a
time as `convert` streams one model.

    MergeConfig -> check -> open every model (one family, one shape: checked from the headers) -> plan (the
        per-model method widened to every model) -> the forecast (one line where it will not fit) -> report the
        non-FFN weights the expert models do not share with the base -> the gate's passes (prompts, data) ->
        tensors streamed into shards -> config, code, tokenizer, merge recipe, card -> the temporary folder
        replaces the output (or, with `architecture`, is exported into it)

A failed or interrupted merge leaves nothing behind and never touches its sources.
"""

import logging
import tempfile
from pathlib import Path

from ..conversion.pipeline import ConversionResult, check_not_source, check_output
from ..conversion.settings import RunOptions
from .config import MERGE_RECIPE_FILE, MergeConfig, save_merge_recipe

logger = logging.getLogger(__name__)


def merge(config: MergeConfig, run: RunOptions, *, download=None) -> ConversionResult:
    """Merge as `config` says into the folder `run.output` (`run`: output, overwrite, device, shard size, eval,
    progress; its `model` and `dtype` are the config's). `download`: the Hub seam, as in `convert`."""
    import dataclasses

    from ..conversion.registry import ROUTER_INITS
    from .plan import MergePlan
    from .sources import MergedSource, open_models

    config.check()
    ROUTER_INITS[config.gate_mode].check_experts(config.experts)  # an unknown gate mode, a missing prompt: one line
    run = dataclasses.replace(run, model=config.base_model, dtype=config.dtype, revision=config.base_revision)
    run.check()
    output = check_output(run)
    base, experts, shared = open_models(config, allow_pickle=run.allow_pickle, token=run.token, download=download)
    for source in (base, *experts, *shared):
        check_not_source(output, source)
    source = MergedSource(base, experts, shared, average=config.non_ffn == "average")
    plan = MergePlan.for_merge(config, source, run)
    _check_architecture(config, plan.config)
    context = gate_context(plan, source)
    prepare_gate(plan, context, report=True)
    if config.architecture == "llama_moe":
        return _merge_into(output, plan, context)
    return _merge_and_export(output, plan, context)


def _merge_into(output: Path, plan, context) -> ConversionResult:
    import torch

    from ..checkpoints.atomic import atomic_folder

    config, source = plan.merge, plan.source
    plan.config.dtype = getattr(torch, config.dtype) if config.dtype else source.dtype
    with atomic_folder(output) as tmp:
        result = _write(plan, source, context, tmp, config)
    result.output_dir = output
    return result


def gate_context(plan, source):
    """The calibration context of a merge's gate (`expert_inputs`: every expert model's prompts or data), after the
    forecast (`conversion.pipeline.check_memory`: one line where it will not fit); no weight read yet."""
    from ..conversion.calibration import CalibrationContext
    from ..conversion.pipeline import check_memory
    from ..conversion.routers.base import ExpertInputs

    merge, run = plan.merge, plan.run
    context = CalibrationContext(
        plan.recipe,
        source.load_model,
        source.load_tokenizer,
        device=run.device,
        progress=run.progress,
        source=source.base,  # the statistics of the base model's layers, one at a time
        offload_dir=run.offload_dir,
    )
    context.expert_inputs = ExpertInputs(
        merge.experts,
        merge.experts_per_model,
        source,
        source.load_tokenizer,
        hidden_token=merge.hidden_token,
        gate_tokens=merge.gate_tokens,
        device=run.device,
    )
    plan.request(context)
    check_memory(plan, run, source.dtype, context.requested)
    return context


def prepare_gate(plan, context, report: bool = False) -> None:
    """The gate's passes over the models (`plan.prepare`), then the base model they loaded released; with `report`,
    first the non-FFN weights the expert models do not share with the base (read a tensor at a time, so after the
    forecast)."""
    from .sources import non_ffn_differences, report_differences

    source = plan.source
    if report:
        report_differences(non_ffn_differences(source.base, source.experts + source.shared), plan.merge.non_ffn)
    plan.prepare(context)
    context.release()


def _check_architecture(config: MergeConfig, output_config) -> None:
    """Refuse, before any work, a layout the export target cannot express exactly (every reason in one line)."""
    from ..export import TARGETS

    if config.architecture != "llama_moe":
        reasons = TARGETS[config.architecture].supports(output_config)
        if reasons:
            raise ValueError(f"Cannot merge into {config.architecture} exactly: {'; '.join(reasons)}.")


def _write(plan, source, context, folder: Path, config: MergeConfig) -> ConversionResult:
    from ..conversion.pipeline import quality_check, write_checkpoint
    from ..conversion.target import MLP
    from .card import write_merge_card

    run = plan.run
    total, active = write_checkpoint(plan, source, context, folder, merge_info(config, source))
    save_merge_recipe(folder / MERGE_RECIPE_FILE, config)
    router = plan.components[MLP][1]
    if router.mix_stage:
        from .mix import train_routers

        train_routers(folder, router, context.expert_inputs)
    quality = quality_check(folder, source.base, run, total)
    write_merge_card(folder, plan, source, total, active, quality)
    return ConversionResult(
        folder, total, active, sorted(p.name for p in folder.iterdir()), plan.recipe, quality=quality
    )


def merge_info(config: MergeConfig, source) -> dict:
    """`conversion_info["merge"]`: every source with the revision read, the gate and its inputs."""
    models = [*source.experts, *source.shared]
    entries = [*config.experts, *config.shared_experts]
    sources = [source_entry(model, entry) for model, entry in zip(models, entries, strict=True)]
    return {
        "merge": {
            "base_model": source.base.reference,
            "experts": sources[: len(config.experts)],
            "shared_experts": sources[len(config.experts) :],
            "gate_mode": config.gate_mode,
            "non_ffn": config.non_ffn,
            "method": config.method,
            "experts_per_model": config.experts_per_model,
        }
    }


def source_entry(model, entry) -> dict:
    fields = {"source_model": model.reference, "revision": entry.revision or _commit(model)}
    for key in ("positive_prompts", "negative_prompts"):
        if getattr(entry, key):
            fields[key] = list(getattr(entry, key))
    for key in ("data", "noise_scale", "residual_scale"):
        fields[key] = getattr(entry, key)
    return fields


def _commit(model) -> str | None:
    """The Hub commit of a downloaded snapshot (its folder name), else None."""
    path = Path(model.path)
    return path.name if model.hub_id and path.parent.name == "snapshots" else None


def _merge_and_export(output: Path, plan, context) -> ConversionResult:
    """Merge into a temporary LlamaMoE folder beside the output, then export it exactly into the output."""
    import dataclasses

    from ..checkpoints.atomic import atomic_file
    from ..conversion.pipeline import quality_check
    from ..export import export_model

    run = plan.run
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.merge-") as staging:
        merged = Path(staging) / "llama_moe"
        plan.run = dataclasses.replace(run, output=str(merged), overwrite=False, eval=False)
        result = _merge_into(merged, plan, context)
        exported = export_model(
            merged, plan.merge.architecture, output, overwrite=run.overwrite, progress=run.progress, eval=False
        )
    for note in exported.notes:
        logger.info("note: %s", note)
    with atomic_file(output / MERGE_RECIPE_FILE) as tmp:
        save_merge_recipe(tmp, plan.merge)
    # Checked as written, in the exported family and dtype, against the base model (as a merge into llama_moe is)
    result.quality = quality_check(output, plan.source.base, run, result.total_parameters)
    result.output_dir, result.files = output, sorted(p.name for p in output.iterdir())
    return result

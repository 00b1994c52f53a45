"""`llama-moe merge --add-expert MODEL --into MOE --output DIR`: one more expert model in a merged LlamaMoE.

    MOE's merge_recipe.yaml + MODEL -> checks (a LlamaMoE merge with softmax top-k routers; MODEL of the base's family
        and shapes: `check_compatible` against the base the recipe names; MOE's tensors the recipe's shapes) -> the
        merge's plan widened by MODEL, its gate's passes -> MOE's tensors streamed, each MoE layer's experts and
        router rows extended -> config (`num_experts`, `conversion_info["merge"]`), recipe, card, MOE's other files

MODEL's FFN becomes expert E (the merge's `experts_per_model` experts: whole copies, `upcycle` only), its router row
made by the merge's gate mode as a fresh merge with MODEL last would make it. Everything else is MOE's, byte for byte:
with softmax top-k renormalised over the selected experts, a token whose top-k leaves out the new expert gets the
same output as before.
"""

import dataclasses
import re
from pathlib import Path

from ..conversion.pipeline import ConversionResult
from ..conversion.settings import RunOptions
from .config import MERGE_RECIPE_FILE, ExpertSource, MergeConfig, config_from_dict, read_yaml, save_merge_recipe

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
GROWN = re.compile(r"^model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


def add_expert(
    into,
    model,
    output,
    *,
    positive_prompts=(),
    negative_prompts=(),
    data=None,
    run: RunOptions | None = None,
) -> ConversionResult:
    """Write to `output` the merged MoE `into` with `model`'s FFN as one more expert model (its router rows by the
    merge's gate mode from these prompts or data); `run`: overwrite, device, shard size, eval, progress, token."""
    from ..checkpoints.atomic import atomic_folder
    from ..conversion.pipeline import check_not_source, check_output
    from ..conversion.registry import ROUTER_INITS
    from .pipeline import gate_context, prepare_gate
    from .plan import MergePlan

    moe = open_merged(into)
    new = ExpertSource(str(model), tuple(positive_prompts), tuple(negative_prompts), data=data)
    merge = widened_recipe(moe, new)
    gate = ROUTER_INITS[merge.gate_mode]
    if gate.needs_expert_inputs and not (new.positive_prompts or new.data):
        raise ValueError(
            f"Gate mode {merge.gate_mode!r} of {moe.path} makes each expert's router row from its prompts or data: "
            "give --positive-prompts (or --data)."
        )
    run = dataclasses.replace(
        run or RunOptions(),
        output=None if output is None else str(output),
        model=merge.base_model,
        revision=merge.base_revision,
        dtype=merge.dtype,
    )
    run.check()
    output = check_output(run)
    source, added = open_sources(merge, run, average_inputs=gate.needs_expert_inputs)
    for opened in (moe, source.base, added):
        check_not_source(output, opened)
    plan = MergePlan.for_merge(merge, source, run)
    check_matches(plan, moe)
    context = gate_context(plan, source)
    prepare_gate(plan, context)
    with atomic_folder(output) as tmp:
        result = write(plan, moe, added, context, tmp)
    result.output_dir = output
    return result


def open_merged(into):
    """The merged folder, read a tensor at a time; one ValueError unless it is a LlamaMoE merge whose routers are
    softmax top-k without compensation (what keeps the old experts' routing when one is added)."""
    from ..checkpoints.converted import open_checkpoint

    path = Path(into).expanduser()
    if not (path / MERGE_RECIPE_FILE).is_file():
        raise ValueError(f"--into {path} is not a merged model (no {MERGE_RECIPE_FILE}); merge with `llama-moe merge`.")
    moe = open_checkpoint(path)
    config = moe.config
    if config.model_type != "llama_moe":
        raise ValueError(f"--into {path} is a {config.model_type!r} model; experts are added to LlamaMoE merges only.")
    from llama_moe_hf.modeling.configuration_llama_moe import DEFAULT_ROUTER_TYPE

    if config.router_type != DEFAULT_ROUTER_TYPE or config.moe_compensation:
        raise ValueError(
            f"--into {path} routes with {config.router_type!r}"
            f"{' and compensation' if config.moe_compensation else ''}: adding an expert keeps the other experts' "
            f"routing only under softmax top-k (router_type {DEFAULT_ROUTER_TYPE}, no compensation)."
        )
    return moe


def widened_recipe(moe, new: ExpertSource) -> MergeConfig:
    """The merge recipe of `moe` with `new` as its last expert model, checked."""
    recipe = config_from_dict(read_yaml(moe.path / MERGE_RECIPE_FILE), str(moe.path / MERGE_RECIPE_FILE))
    if recipe.experts_per_model > 1 and recipe.method != "upcycle":
        raise ValueError(
            f"{moe.path} splits each model's FFN ({recipe.method}, {recipe.experts_per_model} experts each); "
            "an expert is added only to merges that keep whole FFNs (method upcycle)."
        )
    merge = dataclasses.replace(recipe, experts=(*recipe.experts, new))
    merge.check()
    return merge


def open_sources(merge: MergeConfig, run: RunOptions, *, average_inputs: bool) -> tuple:
    """(the `MergedSource` the merge's gate read, the added model checked against the base). With `non_ffn: average`
    a gate that reads hidden states needs the merge's other models too (their average is the MoE's non-FFN part)."""
    from ..checkpoints import open_source
    from .sources import MergedSource, check_compatible

    def opened(entry: ExpertSource):
        return open_source(entry.source_model, allow_pickle=run.allow_pickle, revision=entry.revision, token=run.token)

    base = open_source(merge.base_model, allow_pickle=run.allow_pickle, revision=merge.base_revision, token=run.token)
    base.check_complete()
    new = merge.experts[-1]
    added = opened(new)
    check_compatible(base, added, new.describe())
    average = merge.non_ffn == "average" and average_inputs
    others = [opened(entry) for entry in merge.experts[:-1]] if average else []
    return MergedSource(base, others, [], average=average), added


def check_matches(plan, moe) -> None:
    """Every tensor of `moe` has the shape the recipe's merge gives it (its expert tensors one model fewer)."""
    from ..checkpoints.writer import read_shapes

    shapes = read_shapes(moe.path)
    added = plan.merge.experts_per_model
    if set(shapes) != set(plan.expected):
        odd = sorted(set(shapes) ^ set(plan.expected))
        raise ValueError(f"{moe.path} does not have the tensors its {MERGE_RECIPE_FILE} gives ({odd[:2]}, ...).")
    for name, shape in shapes.items():
        expected = plan.expected[name]
        if GROWN.match(name):
            expected = (expected[0] - added, *expected[1:])
        if shape != expected:
            raise ValueError(
                f"{moe.path} has {name} of shape {shape}, its {MERGE_RECIPE_FILE} with the added model gives "
                f"{expected}: the model and the MoE are not of one shape."
            )


def write(plan, moe, added, context, folder: Path) -> ConversionResult:
    """Weights, config, recipe, card and `moe`'s other files (tokenizer, code) into `folder`."""
    import shutil

    from ..checkpoints.writer import SAFE_INDEX, ShardedWriter
    from ..conversion.pipeline import quality_check
    from ..conversion.registry import count_parameters
    from .card import write_merge_card

    run, source = plan.run, plan.source
    writer = ShardedWriter(folder, plan.expected, moe.dtype, run.max_shard_size)
    for name, tensor in extended_tensors(plan, moe, added, context):
        writer.add(name, tensor)
    config = extended_config(plan, moe.config, added)
    total, active = count_parameters(config, writer.shapes)
    writer.close(total_parameters=total)
    rewritten = {"config.json", "README.md", MERGE_RECIPE_FILE, SAFE_INDEX}
    for path in sorted(moe.path.iterdir()):  # tokenizer, code, generation config: as they are
        kept = path.suffix != ".safetensors" and path.name not in rewritten and not path.name.startswith(".")
        if kept and path.is_file():
            shutil.copyfile(path, folder / path.name)
    config.save_pretrained(folder)
    save_merge_recipe(folder / MERGE_RECIPE_FILE, plan.merge)
    # No MiX stage (the `trained` gate's): it would retrain the other experts' router rows.
    quality = quality_check(folder, source.base, run, total)
    plan.config = config
    write_merge_card(folder, plan, source, total, active, quality)
    files = sorted(p.name for p in folder.iterdir())
    return ConversionResult(folder, total, active, files, plan.recipe, quality=quality)


def extended_tensors(plan, moe, added, context):
    """(name, tensor) of every tensor of `moe`, each MoE layer's experts and router rows with the added model's after
    them; the rest as read."""
    import torch
    from tqdm.auto import tqdm

    def in_layer_order(name: str):  # the gate's layers in order (a gate may run the model a layer at a time)
        layer = LAYER.match(name)
        return (int(layer[1]) if layer else -1, name)

    layer, rows = None, {}
    names = sorted(moe.names(), key=in_layer_order)
    for name in tqdm(names, desc="Adding the expert", unit="tensor", disable=not plan.run.progress):
        tensor = moe.tensor(name)
        grown = GROWN.match(name)
        if grown:
            if int(grown[1]) != layer:
                layer = int(grown[1])
                rows = new_rows(plan, added, layer, context)
            tensor = torch.cat([tensor, rows[grown[2]].to(tensor.dtype)])
        yield name, tensor


def new_rows(plan, added, layer_idx: int, context) -> dict:
    """One MoE layer's added experts (`experts.*`) and their router rows (`gate.weight`): the merge's method on the
    added model's FFN, and the last rows of the merge's gate over every expert model."""
    from ..conversion.target import MLP, LayerBuild
    from .plan import EXPERT_TENSORS

    method, router = plan.components[MLP]
    source, count = plan.source, plan.merge.experts_per_model
    tensors = method.build(layer_idx, source.ffn(added, layer_idx), context).tensors
    dense = source.ffn(source.base, layer_idx)
    gate = router.tensors(layer_idx, LayerBuild(dense=dense, tensors=tensors), context)
    return {name: tensors[name] for name in EXPERT_TENSORS} | {"gate.weight": gate["weight"][-count:]}


def extended_config(plan, config, added):
    """`moe`'s config with the added experts counted and the added model in `conversion_info`."""
    from .pipeline import source_entry

    config.num_experts = plan.config.num_experts
    info = dict(config.conversion_info or {})
    merge = dict(info.get("merge", {}))
    merge["experts"] = [*merge.get("experts", []), source_entry(added, plan.merge.experts[-1])]
    info["merge"] = merge
    info["recipe"] = plan.recipe.to_dict()
    config.conversion_info = info
    return config

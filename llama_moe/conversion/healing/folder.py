"""`llama-moe heal`: heal an existing MoE folder against its dense teacher (`layer.LayerHealer`), into a new folder.

    MoE folder + dense teacher -> calibration tokens (the MoE folder's tokenizer) -> one layer at a time: its tensors
        read, its MoE MLP healed, written -> config (with what healing did), code, tokenizer, recipe (with the heal
        settings), card -> the temporary folder replaces the output

The teacher defaults to the dense model the folder was converted from (its `moe_recipe.yaml`). Progress is kept beside
the output until it is written, so running the same command again after an interruption resumes at the next layer.
"""

import json
import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..recipe import RECIPE_FILE, load_recipe, save_recipe
from ..settings import RecipeFields, RunOptions

logger = logging.getLogger(__name__)


def _recipe_field(name: str):
    """The recipe's field `name` with its default, help and choices, without its "healing: " prefix (one copy of
    each)."""
    recipe_field = RecipeFields.__dataclass_fields__[name]
    help_text = recipe_field.metadata["help"].removeprefix("healing: ")
    return field(default=recipe_field.default, metadata={**recipe_field.metadata, "help": help_text})


@dataclass(frozen=True)
class HealOptions:
    """What `llama-moe heal` takes besides the folder (`heal_*` are the recipe's healing fields)."""

    output: str | None = field(default=None, metadata={"help": "output folder (must not exist)"})
    teacher: str | None = field(
        default=None,
        metadata={"help": "the dense model: folder, Hub id or .gguf (default: the one the folder was converted from)"},
    )
    heal_tokens: int = field(default=32768, metadata={"help": "calibration tokens to heal on"})
    heal_epochs: int = _recipe_field("heal_epochs")
    heal_lr: float = _recipe_field("heal_lr")
    heal_batch_tokens: int = _recipe_field("heal_batch_tokens")
    heal_schedule: str = _recipe_field("heal_schedule")
    heal_target: str = _recipe_field("heal_target")
    heal_routing_weight: float = _recipe_field("heal_routing_weight")
    device: str | None = field(default=None, metadata={"help": "device (default: cuda if available, else cpu)"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output folder at the end"})
    progress: bool = field(default=True, metadata={"help": "show progress bars"})
    force: bool = field(
        default=False, metadata={"help": "heal even where the forecast says it will not fit in the free memory or disk"}
    )


def heal_folder(folder, options: HealOptions, *, download=None) -> Path:
    """Heal the MoE folder `folder` into `options.output`; returns the output folder."""
    from ...checkpoints.converted import open_checkpoint
    from ..pipeline import check_not_source, check_output
    from .layer import state_dir_for

    output = check_output(RunOptions(output=options.output, overwrite=options.overwrite))
    moe = open_checkpoint(folder)
    check_not_source(output, moe)
    recipe, run = _folder_recipe(moe.path)
    teacher = _open_teacher(options.teacher, run, download)
    _check_teacher(moe.config, teacher.config)
    # The heal tokens come from the folder's own calibration data, so that its recipe file builds it again.
    recipe = replace(
        recipe,
        **{name: getattr(options, name) for name in HealOptions.__dataclass_fields__ if name.startswith("heal_")},
    )
    from ..plan import resolve_recipe

    # The heal settings checked like a conversion's; the target's default depends on the family.
    recipe = replace(recipe, heal_target=resolve_recipe(recipe).heal_target)
    check_forecast(recipe, run, teacher, moe.dtype, output, options)
    state_dir = state_dir_for(output)
    _write(moe, teacher, recipe, run, options, output, state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
    return output


def check_forecast(recipe, run: dict, teacher, dtype, output: Path, options: HealOptions) -> None:
    """The heal's memory, disk and time forecast (`forecast.heal_forecast`, on the plan the folder's recipe gives
    for its teacher), logged; one ValueError where a stage will not fit, unless `--force`."""
    from ...devices import default_device
    from ...footprint import available_bytes
    from .. import forecast
    from ..plan import ConversionPlan

    plan = ConversionPlan.create(recipe, teacher.config, RunOptions(**{**run, "output": str(output)}))
    available = available_bytes("cpu")
    stages = forecast.heal_forecast(plan, dtype.itemsize)
    forecast.check_forecast(stages, available, options.force)
    forecast.report(stages, available, options.device or default_device(), plan.dense_config)


def _folder_recipe(folder: Path):
    """The folder's recipe and run settings (`moe_recipe.yaml`), or one line saying it has none."""
    if not (folder / RECIPE_FILE).is_file():
        raise FileNotFoundError(f"{folder} has no {RECIPE_FILE}: heal needs a folder written by `llama-moe convert`.")
    recipe, run = load_recipe(folder / RECIPE_FILE)
    return recipe, run


def _open_teacher(teacher: str | None, run: dict, download):
    """The dense teacher: `teacher`, else the model the folder was converted from (`model: null`: the built-in)."""
    from ...checkpoints import open_source

    model = teacher if teacher is not None else run.get("model")
    seams = {"download": download} if download else {}
    return open_source(model, revision=None if teacher else run.get("revision"), **seams)


def _check_teacher(config, teacher_config) -> None:
    fields = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
    different = [f for f in fields if getattr(config, f) != getattr(teacher_config, f)]
    if different:
        raise ValueError(
            f"The teacher is not the dense model of this MoE ({', '.join(different)} differ); give the dense model it "
            "was converted from with --teacher."
        )


def _write(moe, teacher, recipe, run: dict, options: HealOptions, output: Path, state_dir: Path) -> None:
    from transformers.dynamic_module_utils import custom_object_save

    from ...checkpoints.atomic import atomic_folder
    from ...checkpoints.writer import ShardedWriter, read_shapes

    config = moe.config
    model = _meta_model(config)
    healer = _healer(moe, teacher, recipe, options, model, state_dir)
    with atomic_folder(output) as tmp:
        writer = ShardedWriter(tmp, read_shapes(moe.path), moe.dtype, run.get("max_shard_size") or "5GB")
        for name, tensor in _healed_tensors(moe, teacher, healer, options.progress):
            writer.add(name, tensor)
        writer.close()
        config.conversion_info = {**(config.conversion_info or {}), **healer.info()}
        model.add_auto_map()
        custom_object_save(model, tmp, config=config)
        config.save_pretrained(tmp)
        moe.save_extras(tmp)
        save_recipe(tmp / RECIPE_FILE, recipe, RunOptions(**run))
        _write_card(moe.path, tmp, healer.info()["healing"])


def _meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _healer(moe, teacher, recipe, options: HealOptions, model, state_dir: Path):
    from ..calibration import CalibrationContext
    from .layer import LayerHealer

    # The conversion's own way to its calibration tokens: `builtin:chat` has the teacher answer its prompts
    context = CalibrationContext(recipe, teacher.load_model, moe.load_tokenizer, device=options.device, progress=False)
    tokens = context.tokens(recipe.heal_tokens)
    context.release()
    identity = json.dumps([_weights_identity(moe.path), teacher.description])
    embeddings = moe.tensor("model.embed_tokens.weight")
    return LayerHealer.for_model(recipe, model, embeddings, tokens, options.device, state_dir, identity)


def _weights_identity(folder: Path) -> list:
    """The folder's weight files by name, size and modification time: another folder's, or the same folder's written
    again, do not resume this one's healing."""
    files = sorted(folder.glob("*.safetensors*"))
    return [(path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in files]


def _healed_tensors(moe, teacher, healer, progress: bool):
    """Every tensor of the folder, the decoder layers' with their MoE MLPs healed, one layer at a time."""
    from tqdm.auto import tqdm

    layered = {f"model.layers.{i}." for i in range(moe.config.num_hidden_layers)}
    for name in moe.names():
        if not any(name.startswith(prefix) for prefix in layered):
            yield name, moe.tensor(name)
    for layer_idx in tqdm(range(moe.config.num_hidden_layers), desc="Healing layers", disable=not progress):
        prefix = f"model.layers.{layer_idx}."
        tensors = {n[len(prefix) :]: moe.tensor(n) for n in moe.layer_names(layer_idx)}
        for name, tensor in healer.heal(layer_idx, tensors, teacher.layer_tensors(layer_idx)).items():
            yield prefix + name, tensor


def _write_card(folder: Path, tmp: Path, healing: dict) -> None:
    """The folder's card with a Healing section (what was trained and how much it cut the MLPs' error)."""
    from ...hub.card import replace_section

    card = folder / "README.md"
    if not card.is_file():
        return
    goal = "hidden states after its layer" if healing.get("target") == "stream" else "MLP output"
    section = (
        "## Healing\n\n"
        f"Each MoE MLP was trained, layer after layer, to reproduce the dense model's {goal} on "
        f"{healing['tokens']:,} calibration tokens passed through the already-healed earlier layers (`llama-moe heal`, "
        f"{healing['epochs']} epochs, Adam lr {healing['lr']}, routing weight {healing['routing_weight']}). "
        f"Mean relative MLP error: {healing.get('error_before', float('nan')):.3f} before, "
        f"{healing.get('error_after', float('nan')):.3f} after.\n"
    )
    (tmp / "README.md").write_text(replace_section(card.read_text(encoding="utf-8"), "## Healing", section))

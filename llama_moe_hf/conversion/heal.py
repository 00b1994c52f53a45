"""`llama-moe heal`: heal an existing MoE folder against its dense teacher (`healing.LayerHealer`), into a new folder.

    MoE folder + dense teacher -> calibration tokens (the MoE folder's tokenizer) -> one layer at a time: its tensors
        read, its MoE MLP healed, written -> config (with what healing did), code, tokenizer, recipe (with the heal
        settings), card -> the temporary folder replaces the output

The teacher defaults to the dense model the folder was converted from (its `moe_recipe.yaml`). Progress is kept beside
the output until it is written, so running the same command again after an interruption resumes at the next layer.
"""

import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from .recipe import RECIPE_FILE, RunOptions, load_recipe, save_recipe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealOptions:
    """What `llama-moe heal` takes besides the folder (`heal_*` are the recipe's healing fields)."""

    output: str | None = field(default=None, metadata={"help": "output folder (must not exist)"})
    teacher: str | None = field(
        default=None,
        metadata={"help": "the dense model: folder, Hub id or .gguf (default: the one the folder was converted from)"},
    )
    heal_tokens: int = field(default=32768, metadata={"help": "calibration tokens to heal on"})
    heal_epochs: int = field(default=4, metadata={"help": "passes over the heal tokens"})
    heal_lr: float = field(default=1e-3, metadata={"help": "Adam learning rate"})
    heal_batch_tokens: int = field(default=512, metadata={"help": "tokens per step"})
    heal_routing_weight: float = field(
        default=0.1, metadata={"help": "weight of the term that ranks the experts by what leaving them out costs"}
    )
    calibration_data: str | None = field(
        default=None, metadata={"help": "text/json/jsonl/parquet file or folder, or a datasets name (default: the "
                                "folder's calibration data)"}
    )  # fmt: skip
    device: str | None = field(default=None, metadata={"help": "device (default: cuda if available, else cpu)"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output folder at the end"})
    progress: bool = field(default=True, metadata={"help": "show progress bars"})


def heal_folder(folder, options: HealOptions, *, download=None) -> Path:
    """Heal the MoE folder `folder` into `options.output`; returns the output folder."""
    from .pipeline import _check_not_source, _check_output
    from .sources.converted import open_checkpoint

    output = _check_output(RunOptions(output=options.output, overwrite=options.overwrite))
    moe = open_checkpoint(folder)
    _check_not_source(output, moe)
    recipe, run = _folder_recipe(moe.path)
    teacher = _open_teacher(options.teacher, run, download)
    _check_teacher(moe.config, teacher.config)
    recipe = replace(
        recipe,
        calibration_data=options.calibration_data or recipe.calibration_data,
        **{name: getattr(options, name) for name in HealOptions.__dataclass_fields__ if name.startswith("heal_")},
    )
    from .plan import resolve_recipe

    resolve_recipe(recipe)  # the heal settings checked like a conversion's
    state_dir = output.with_name(f".{output.name}.healing")
    _write(moe, teacher, recipe, run, options, output, state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
    return output


def _folder_recipe(folder: Path):
    """The folder's recipe and run settings (`moe_recipe.yaml`), or one line saying it has none."""
    if not (folder / RECIPE_FILE).is_file():
        raise FileNotFoundError(f"{folder} has no {RECIPE_FILE}: heal needs a folder written by `llama-moe convert`.")
    recipe, run = load_recipe(folder / RECIPE_FILE)
    return recipe, run


def _open_teacher(teacher: str | None, run: dict, download):
    """The dense teacher: `teacher`, else the model the folder was converted from (`model: null`: the built-in)."""
    from .sources import open_source

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

    from .writer import ShardedWriter, atomic_folder, read_shapes

    config = moe.config
    model = _meta_model(config)
    healer = _healer(moe, recipe, options, model, state_dir)
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
        save_recipe(tmp / RECIPE_FILE, recipe, RunOptions(**{k: v for k, v in run.items() if k != "tokenizer"}))
        _write_card(moe.path, tmp, healer.info()["healing"])


def _meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _healer(moe, recipe, options: HealOptions, model, state_dir: Path):
    import torch

    from .calibration import load_calibration_texts, tokenize_calibration
    from .healing import HealSettings, LayerHealer

    texts, _ = load_calibration_texts(recipe.calibration_data, max_chars=16 * recipe.heal_tokens)
    tokens = tokenize_calibration(texts, moe.load_tokenizer(), recipe.heal_tokens, recipe.calibration_seq_len)
    settings = HealSettings(
        recipe.heal_tokens, recipe.heal_epochs, recipe.heal_lr, recipe.heal_batch_tokens,
        recipe.heal_routing_weight, recipe.seed,
    )  # fmt: skip
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backbone = model.model
    embeddings = moe.tensor("model.embed_tokens.weight")
    layer_class, rotary_class = type(backbone.layers[0]), type(backbone.rotary_emb)
    return LayerHealer(settings, moe.config, layer_class, rotary_class, embeddings, tokens, device, state_dir)


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
        dense = {n[len(prefix) :]: teacher.tensor(n) for n in teacher.layer_names(layer_idx) if ".mlp." in n}
        for name, tensor in healer.heal(layer_idx, tensors, dense).items():
            yield prefix + name, tensor


def _write_card(folder: Path, tmp: Path, healing: dict) -> None:
    """The folder's card with a Healing section (what was trained and how much it cut the MLPs' error)."""
    from .card import replace_section

    card = folder / "README.md"
    if not card.is_file():
        return
    section = (
        "## Healing\n\n"
        f"Each MoE MLP was trained, layer after layer, to reproduce the dense model's MLP output on "
        f"{healing['tokens']:,} calibration tokens passed through the already-healed earlier layers (`llama-moe heal`, "
        f"{healing['epochs']} epochs, Adam lr {healing['lr']}, routing weight {healing['routing_weight']}). "
        f"Mean relative MLP error: {healing.get('error_before', float('nan')):.3f} before, "
        f"{healing.get('error_after', float('nan')):.3f} after.\n"
    )
    (tmp / "README.md").write_text(replace_section(card.read_text(encoding="utf-8"), "## Healing", section))

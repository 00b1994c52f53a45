"""The training card of a model trained by TRL's own command line (`trl sft --config FILE`).

`trl sft` never imports this package: the checkpoint's remote code trains, and TRL offers no callback hook. The one
code of ours that runs there is the model's `save_pretrained`, which calls the functions the installed package
registers in the `llama_moe_hf.model_saved` entry-point group (setup.py). `on_model_saved` is that function: when a
Trainer that is not one of our recipes' saves the model, it writes the history and card our recipes write
(`checkpoint.render_training_card`), with the data read from TRL's script arguments. Without the package installed,
TRL's own card stays.
"""

import inspect
import logging
from pathlib import Path

from .checkpoint import stage_record, write_training_record
from .resume import ResumableCheckpointsMixin
from .sft import data_shares

logger = logging.getLogger(__name__)
UNKNOWN_DATA = "data not recorded"


def on_model_saved(model, save_directory, is_main_process: bool = True) -> None:
    """Write `training_history.json`, the conversion recipe and README.md next to a model a foreign Trainer saved."""
    trainer, script_args, dataset_args = _callers()
    if not is_main_process or trainer is None or isinstance(trainer, ResumableCheckpointsMixin):
        return  # not training, or one of our recipes, which writes the complete checkpoint itself
    # where the model was loaded from; never "" (the current folder's README would pass for its card)
    source = str(getattr(model.config, "_name_or_path", "") or "") or "a model built in memory"
    record = stage_record(
        trainer,
        "trl sft",
        _data(script_args, dataset_args),
        source,
        examples=len(trainer.train_dataset) if hasattr(trainer.train_dataset, "__len__") else 0,
        packing=getattr(trainer.args, "packing", False),
    )
    name = Path(trainer.args.output_dir).resolve().name  # a checkpoint-N folder is still the run's model
    write_training_record(Path(save_directory), name, source, record)
    logger.info("Wrote the llama-moe-hf training card to %s", Path(save_directory) / "README.md")


def _callers() -> tuple:
    """The Trainer that is saving (the nearest caller frame's `self` that is one) and TRL's script arguments
    (`trl sft`'s `main` holds them as `script_args` and `dataset_args`)."""
    from transformers import Trainer

    trainer = script_args = dataset_args = None
    for frame_info in inspect.stack(context=0)[1:]:
        names = frame_info.frame.f_locals
        if trainer is None and isinstance(names.get("self"), Trainer):
            trainer = names["self"]
        if dataset_args is None and hasattr(names.get("dataset_args"), "datasets"):
            script_args, dataset_args = names.get("script_args"), names["dataset_args"]
    return trainer, script_args, dataset_args


def _data(script_args, dataset_args) -> dict:
    """Each dataset's share, as `recipes/sft.py` records it."""
    if dataset_args is not None and (dataset_args.datasets or getattr(script_args, "dataset_name", None)):
        return data_shares(script_args, dataset_args)
    return {UNKNOWN_DATA: None}

"""Resuming a killed run from the newest complete checkpoint in its output folder.

As transformers' example scripts do (`run_clm.py`), a recipe run again with the same `output_dir` continues from the
last checkpoint there unless told to start over. Two guarantees the Trainer alone does not give:
- a checkpoint counts only once every process has written all of it: `ResumableCheckpointsMixin` marks the folder
  `INCOMPLETE_MARKER` before the first file and removes the mark after a barrier at the end (older checkpoints are
  rotated out only then), so a kill in the middle of a save leaves a marked folder;
- a marked folder is never chosen, and the main process removes it before training starts.
What a recipe needs beyond the Trainer's own state (the domain mixture's sampling weights) goes into the folder
through `save_extra_state`, before the Trainer's files.
Light (no torch or transformers at import): the recipes' preflight checks `--resume_from_checkpoint` with it.
"""

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX_CHECKPOINT_DIR = "checkpoint"  # transformers.trainer_utils' name for checkpoint-STEP folders
INCOMPLETE_MARKER = ".incomplete"  # present while a checkpoint is being written
RUN_SHAPE = "run_shape.json"  # the processes and batch sizes the checkpoint was trained with
TRAINER_STATE = "trainer_state.json"  # what the Trainer writes last, and reads to resume
NEVER, LATEST = ("false", "no", "none"), ("true", "yes", "latest", "last")


class ResumableCheckpointsMixin:
    """For Trainer subclasses: checkpoints that are either complete or marked incomplete (see the module)."""

    def save_extra_state(self, folder: Path) -> None:
        """Write what resuming needs besides the Trainer's state into `folder` (main process; default: nothing)."""

    def _issue_warnings_after_load(self, load_result) -> None:
        # Tied weights are saved once (the LM head is the embedding), so the Trainer calls the other name missing and
        # warns of a loss that did not happen; only keys that share no storage with a loaded one are missing.
        missing = real_missing_keys(self.model, load_result.missing_keys)
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def _save_checkpoint(self, model, trial) -> None:
        from transformers.trainer_utils import rotate_checkpoints

        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / INCOMPLETE_MARKER).touch()
            (folder / RUN_SHAPE).write_text(json.dumps(run_shape(self.args)) + "\n")
            self.save_extra_state(folder)
        self.accelerator.wait_for_everyone()
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # rotate once the new one is whole
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every process has written its part (its RNG state)
        if self.args.should_save:
            (folder / INCOMPLETE_MARKER).unlink(missing_ok=True)
            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )


def real_missing_keys(model, missing: list[str]) -> list[str]:
    """The `missing` parameter names of `model` that share no storage with a parameter that was loaded."""
    storage = {name: parameter.data_ptr() for name, parameter in model.named_parameters(remove_duplicate=False)}
    absent = set(missing)
    loaded = {pointer for name, pointer in storage.items() if name not in absent}
    return [name for name in missing if storage.get(name) not in loaded]


def run_shape(training) -> dict:
    """What the position in the data depends on besides the step: resuming with another shape would repeat or skip
    data."""
    return {
        "world_size": training.world_size,
        "per_device_train_batch_size": training.per_device_train_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
    }


def check_run_shape(checkpoint: Path, training) -> None:
    path = Path(checkpoint) / RUN_SHAPE
    saved, ours = (json.loads(path.read_text()) if path.is_file() else None), run_shape(training)
    if saved is not None and saved != ours:
        raise ValueError(
            f"{checkpoint} was trained with {saved}, this run has {ours}: resume with the same processes and batch "
            "sizes (or --overwrite_output_dir true to start over)."
        )


def remove(folder: Path) -> None:
    """Other processes see the checkpoint whole or not at all (`checkpoints.atomic.remove_folder`)."""
    from ..checkpoints.atomic import remove_folder  # here: `checkpoints` imports torch, this module must not

    remove_folder(folder)


def checkpoint_step(path: Path) -> int | None:
    name, _, step = path.name.rpartition("-")
    return int(step) if name == PREFIX_CHECKPOINT_DIR and step.isdigit() and path.is_dir() else None


def is_complete(folder: Path) -> bool:
    return (folder / TRAINER_STATE).is_file() and not (folder / INCOMPLETE_MARKER).exists()


def newest_complete_checkpoint(output_dir: str | Path, clean: bool) -> Path | None:
    """The complete checkpoint of the highest step in `output_dir`; with `clean`, the half-written ones newer than it
    are removed (only the main process should clean)."""
    entries = Path(output_dir).iterdir() if Path(output_dir).is_dir() else ()
    steps = {folder: checkpoint_step(folder) for folder in entries}  # once: another process may be cleaning
    for folder in sorted((f for f, step in steps.items() if step is not None), key=steps.get, reverse=True):
        if is_complete(folder):
            return folder
        if clean and (folder / INCOMPLETE_MARKER).exists():
            logger.warning("Removing %s: a checkpoint whose writing was interrupted.", folder)
            remove(folder)
    return None


def resume_checkpoint(training, start_over: bool = False) -> str | None:
    """The checkpoint a recipe run continues from, or None to start at step 0.

    `training.resume_from_checkpoint`: unset or true/latest, the newest complete checkpoint in `output_dir` (true
    insists one exists); false, none; a path, that checkpoint. `start_over` (the recipes' `--overwrite_output_dir`)
    removes the earlier run's checkpoints instead, so they cannot mix with this run's: call it once the run's input
    has been checked. A checkpoint of another number of processes or batch size is refused."""
    main = training.process_index == 0
    value = check_resume(training, start_over)
    if value is not None and value.lower() in NEVER:
        return None
    if value is not None and value.lower() not in LATEST:
        check_run_shape(Path(value), training)
        return value
    if start_over:
        for folder in Path(training.output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if main else ():
            remove(folder)
        return None
    found = newest_complete_checkpoint(training.output_dir, clean=main)
    if found is not None:
        check_run_shape(found, training)
        logger.warning("Resuming from %s (pass --overwrite_output_dir true to start over).", found)
    return None if found is None else str(found)


def check_resume(values, start_over: bool = False) -> str | None:
    """`values.resume_from_checkpoint` as a string (None: unset), refused in one line when it names a folder that is
    not a complete checkpoint, asks for the latest where `output_dir` has none, or comes with
    `--overwrite_output_dir true`. Changes nothing on disk."""
    value = values.resume_from_checkpoint
    value = None if value is None else str(value).strip()
    if value is None or value.lower() in NEVER:
        return value
    if start_over or getattr(values, "overwrite_output_dir", False):
        raise ValueError("--overwrite_output_dir true starts over: it cannot go with --resume_from_checkpoint.")
    if value.lower() in LATEST:
        if newest_complete_checkpoint(values.output_dir, clean=False) is None:
            raise ValueError(f"resume_from_checkpoint {value}: {values.output_dir} holds no complete checkpoint.")
    elif not is_complete(Path(value)):
        raise ValueError(
            f"resume_from_checkpoint {value}: not a complete checkpoint folder (no {TRAINER_STATE}, or its writing "
            "was interrupted)."
        )
    return value

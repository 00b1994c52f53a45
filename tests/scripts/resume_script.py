"""Launched by test_resume.py (directly or under torchrun): runs the recipe script `argv[1]` with the remaining
arguments as `python RECIPE ...` would, with two seams set by environment variables.

SAMPLES_LOG=PATH  every trained row is appended to PATH.RANK as "GLOBAL_STEP SHA1-OF-ITS-TOKENS"
KILL_AT=step:N    SIGKILL in the middle of optimizer step N+1 (gradients computed, not applied; N steps done)
KILL_AT=save:N    SIGKILL while checkpoint N is written (after the weights, before the optimizer and trainer state)
Only the first process kills itself, as one lost machine would; torchrun then ends the others.
"""

import hashlib
import os
import runpy
import signal
import sys

from transformers import Trainer

RANK = int(os.environ.get("RANK", "0"))
KILL_WHEN, _, KILL_STEP = os.environ.get("KILL_AT", "").partition(":")


def _kill_if(when: str, trainer) -> None:
    if RANK == 0 and KILL_WHEN == when and trainer.state.global_step == int(KILL_STEP):
        os.kill(os.getpid(), signal.SIGKILL)


def _log_rows(trainer, inputs) -> None:
    with open(f"{os.environ['SAMPLES_LOG']}.{RANK}", "a") as log:
        for row in inputs["input_ids"]:
            digest = hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()
            log.write(f"{trainer.state.global_step} {digest}\n")


def install_seams() -> None:
    training_step, save_optimizer = Trainer.training_step, Trainer._save_optimizer_and_scheduler

    def logged_training_step(self, model, inputs, *args, **kwargs):
        if "SAMPLES_LOG" in os.environ:
            _log_rows(self, inputs)
        loss = training_step(self, model, inputs, *args, **kwargs)
        _kill_if("step", self)
        return loss

    def interrupted_save(self, output_dir):
        _kill_if("save", self)
        return save_optimizer(self, output_dir)

    Trainer.training_step = logged_training_step
    Trainer._save_optimizer_and_scheduler = interrupted_save


if __name__ == "__main__":
    install_seams()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")

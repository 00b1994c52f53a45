"""A killed training run, started again with the same command, resumes from its newest complete checkpoint and ends
exactly where an uninterrupted run ends: the same weights bit for bit, every training row seen once in the same
order. Real SIGKILLs (tests/scripts/resume_script.py) of the real recipes, in one process and in two over gloo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llama_moe.training.resume import INCOMPLETE_MARKER

RECIPES = Path(__file__).parents[2] / "recipes"
SCRIPT = Path(__file__).parents[1] / "scripts" / "resume_script.py"
COMMON = [
    "--max_steps",
    "6",
    "--save_strategy",
    "steps",
    "--save_steps",
    "2",
    "--learning_rate",
    "3e-3",
    "--warmup_steps",
    "0",
    "--seed",
    "0",
]
COMMON += ["--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true"]


def _command(processes: int, recipe: str, flags: list[str], output: Path) -> list[str]:
    """`recipe` with `flags`: 6 steps of 4 rows in all, a checkpoint every 2 steps."""
    launcher = [sys.executable, str(SCRIPT), str(RECIPES / recipe)]
    if processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        launcher += [str(SCRIPT), str(RECIPES / recipe), "--ddp_backend", "gloo"]
    flags = flags + ["--per_device_train_batch_size", str(4 // processes)]
    return launcher + flags + COMMON + ["--output_dir", str(output)]


def _pretraining(processes: int, tiny_moe_path, domains, output: Path) -> list[str]:
    """Continual pre-training with dynamic sampling whose weights change every 2 steps."""
    flags = ["--model_name_or_path", str(tiny_moe_path), "--domains", *(f"{n}={p}" for n, p in domains.items())]
    flags += ["--sampling", "dynamic", "--reference_losses", "prose=1.0", "code=3.0", "--update_steps", "2"]
    flags += ["--seq_len", "32", "--eval_blocks", "2"]
    return _command(processes, "continual_pretrain.py", flags, output)


def _run(command: list[str], samples: Path, kill_at: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", SAMPLES_LOG=str(samples))
    env.pop("KILL_AT", None)
    if kill_at:
        env["KILL_AT"] = kill_at
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def _rows(samples: Path, processes: int, before_step: int | None = None) -> list[list[str]]:
    """Per process, the logged (step, row hash) lines in order; with `before_step`, only those of earlier steps."""
    logs = []
    for rank in range(processes):
        lines = Path(f"{samples}.{rank}").read_text().split("\n")[:-1]
        logs.append([line for line in lines if before_step is None or int(line.split()[0]) < before_step])
    return logs


@pytest.fixture(scope="module")
def uninterrupted(tiny_moe_path, domains, tmp_path_factory):
    """The uninterrupted pre-training run's folder and row log, per number of processes (run once each)."""
    runs = {}

    def run(processes: int) -> tuple[Path, Path]:
        if processes not in runs:
            root = tmp_path_factory.mktemp(f"whole-{processes}")
            result = _run(_pretraining(processes, tiny_moe_path, domains, root / "out"), root / "rows")
            assert result.returncode == 0, result.stderr[-3000:]
            runs[processes] = root / "out", root / "rows"
        return runs[processes]

    return run


@pytest.mark.parametrize(
    ("processes", "kill_at", "resumed_from"),
    [(1, "step:4", 4), (1, "save:4", 2), (2, "step:4", 4)],
    ids=["one-process-killed-mid-step", "one-process-killed-mid-save", "ddp-killed-mid-step"],
)
def test_a_killed_run_resumes_to_the_uninterrupted_result(
    processes, kill_at, resumed_from, tiny_moe_path, domains, uninterrupted, tmp_path
):
    whole_folder, whole_rows = uninterrupted(processes)
    command = _pretraining(processes, tiny_moe_path, domains, tmp_path / "out")
    killed = _run(command, tmp_path / "killed-rows", kill_at)
    assert killed.returncode != 0 and not (tmp_path / "out" / "model.safetensors").exists()
    checkpoints = sorted(path.name for path in (tmp_path / "out").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2", "checkpoint-4"]
    assert (tmp_path / "out" / "checkpoint-4" / INCOMPLETE_MARKER).exists() == kill_at.startswith("save")

    resumed = _run(command, tmp_path / "resumed-rows")  # the same command again
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {tmp_path / 'out' / f'checkpoint-{resumed_from}'}" in resumed.stderr
    whole, out = load_file(whole_folder / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert whole.keys() == out.keys() and all(torch.equal(whole[name], out[name]) for name in whole)

    # The rows trained before the checkpoint, then those after it: exactly the uninterrupted run's, in order.
    before = _rows(tmp_path / "killed-rows", processes, before_step=resumed_from)
    after = _rows(tmp_path / "resumed-rows", processes)
    assert [b + a for b, a in zip(before, after)] == _rows(whole_rows, processes)
    assert all(int(line.split()[0]) >= resumed_from for line in after[0])
    history = json.loads((tmp_path / "out" / "training_history.json").read_text())
    assert (
        history[-1]["steps"] == 6
        and history[-1]["final_domain_weights"]
        == json.loads((whole_folder / "training_history.json").read_text())[-1]["final_domain_weights"]
    )
    assert not any((tmp_path / "out").glob(f"checkpoint-*/{INCOMPLETE_MARKER}"))


def test_overwrite_output_dir_starts_over_and_an_explicit_incomplete_checkpoint_is_refused(
    tiny_moe_path, domains, tmp_path
):
    command = _pretraining(1, tiny_moe_path, domains, tmp_path / "out")
    assert _run(command, tmp_path / "killed-rows", "save:4").returncode != 0
    refused = _run(command + ["--resume_from_checkpoint", str(tmp_path / "out" / "checkpoint-4")], tmp_path / "r")
    assert refused.returncode == 2 and "not a complete checkpoint folder" in refused.stderr.strip().splitlines()[-1]
    other_shape = _run(command + ["--gradient_accumulation_steps", "2"], tmp_path / "r")  # would skip other data
    assert other_shape.returncode == 2 and "resume with the same processes and batch sizes" in other_shape.stderr
    assert (tmp_path / "out" / "checkpoint-2").is_dir()

    again = _run(command + ["--overwrite_output_dir", "true"], tmp_path / "again-rows")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming" not in again.stderr
    killed, again = _rows(tmp_path / "killed-rows", 1)[0], _rows(tmp_path / "again-rows", 1)[0]
    assert again[0].startswith("0 ") and again[: len(killed)] == killed  # from step 0, the same rows again
    assert len(again) == 6 * 4


def test_a_killed_sft_stage_resumes_to_the_uninterrupted_result(tiny_moe_path, tmp_path):
    """recipes/sft.py on the stage-1 recipe file (packed chats, TRL's SFTTrainer), killed after its second
    checkpoint."""
    chats = [{"prompt": [{"role": "user", "content": f"say {i}"}], "completion": [{"role": "assistant",
              "content": f"{i} {i % 7}"}]} for i in range(80)]  # fmt: skip
    (tmp_path / "data/offline/sft/chat").mkdir(parents=True)
    (tmp_path / "data/offline/sft/chat/train.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    flags = ["--config", str(RECIPES / "sft/stage1-general.yaml"), "--model_name_or_path", str(tiny_moe_path)]
    flags += ["--max_length", "64", "--gradient_accumulation_steps", "1"]
    runs = {}
    for name, output, kill_at in [("whole", "whole", None), ("killed", "out", "step:4"), ("resumed", "out", None)]:
        command = _command(1, "sft.py", flags, tmp_path / output)
        runs[name] = _run(command, tmp_path / f"{name}-rows", kill_at, cwd=tmp_path)
        assert (runs[name].returncode == 0) == (kill_at is None), runs[name].stderr[-3000:]
    assert f"Resuming from {tmp_path / 'out' / 'checkpoint-4'}" in runs["resumed"].stderr
    whole, out = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(whole[name], out[name]) for name in whole)
    before, after = _rows(tmp_path / "killed-rows", 1, before_step=4), _rows(tmp_path / "resumed-rows", 1)
    assert before[0] + after[0] == _rows(tmp_path / "whole-rows", 1)[0]

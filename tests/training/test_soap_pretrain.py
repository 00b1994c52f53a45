"""The SOAP pre-training recipe (recipes/pretrain_soap.py): dense warm-up, upcycling, training; one process and two
CPU processes with the stock launcher (torchrun, gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "pretrain_soap.py"
TINY = [
    "--config", str(ROOT / "recipes" / "pretrain" / "soap-small.yaml"),
    "--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "2", "--num_key_value_heads", "1",
    "--intermediate_size", "64", "--seq_len", "64", "--segment_length", "16", "--num_experts", "4",
    "--max_steps", "20", "--per_device_train_batch_size", "2", "--validation_documents", "20",
    "--validation_sequences", "4", "--logging_steps", "5", "--use_cpu", "--disable_tqdm", "true",
]  # fmt: skip


def run_recipe(launcher: list[str], output: Path, *flags: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [*launcher, str(RECIPE), *TINY, "--output_dir", str(output), *flags]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=output.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((output / "results.json").read_text())


@pytest.mark.parametrize("flags", [["--similarity_batching"], ["--variant", "dense"]])
def test_recipe_warms_up_dense_then_trains(tmp_path, smollm2_path, flags):
    results = run_recipe([sys.executable], tmp_path / "out", *flags)
    config = AutoConfig.from_pretrained(tmp_path / "out")
    if "dense" in flags:
        assert config.model_type == "llama" and "routing" not in results
    else:
        assert (config.model_type, config.num_experts, config.segment_length) == ("soap_moe", 4, 16)
        assert results["similarity_batching"] and 0 < results["routing"]["utilization"] <= 1
    assert results["train_tokens"] == 20 * 2 * 64
    assert 1 < results["validation_perplexity"] < 49152  # learned something: below a uniform guess over the vocab


def test_recipe_runs_on_two_cpu_processes_with_torchrun(tmp_path, smollm2_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    results = run_recipe(launcher, tmp_path / "out", "--ddp_backend", "gloo")
    assert results["train_tokens"] == 20 * 2 * 2 * 64  # two processes, each its own batches
    assert AutoConfig.from_pretrained(tmp_path / "out").model_type == "soap_moe"
    (stage,) = json.loads((tmp_path / "out" / "training_history.json").read_text())  # a complete checkpoint
    assert (
        stage["world_size"] == 2 and "| 1 | soap-pretraining (soap) |" in (tmp_path / "out" / "README.md").read_text()
    )


def test_a_killed_run_resumes_to_the_uninterrupted_result(tmp_path, smollm2_path):
    """Checkpoints every 4 steps; SIGKILL in the middle of the upcycled stage's step 9 (tests/scripts/resume_script.py), then
    the same command: it skips the finished warm-up, resumes the upcycled stage from its checkpoint 8, and ends with
    the uninterrupted run's weights."""
    launcher = [sys.executable, str(Path(__file__).parents[1] / "scripts" / "resume_script.py")]
    flags = ["--save_strategy", "steps", "--save_steps", "4"]
    run_recipe(launcher, tmp_path / "whole", *flags)
    env = dict(os.environ, OMP_NUM_THREADS="1", KILL_AT="step:8")
    command = [*launcher, str(RECIPE), *TINY, "--output_dir", str(tmp_path / "out"), *flags]
    killed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert killed.returncode != 0 and (tmp_path / "out" / "dense-warmup" / "final" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "out" / "upcycled").glob("checkpoint-*")) == [
        "checkpoint-4",
        "checkpoint-8",
    ]
    run_recipe(launcher, tmp_path / "out", *flags)
    whole, out = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert whole.keys() == out.keys() and all(torch.equal(whole[name], out[name]) for name in whole)

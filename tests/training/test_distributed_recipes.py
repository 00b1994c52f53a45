"""The continual pre-training recipe over two CPU processes computes what it computes in one: under DDP, FSDP2
(`--fsdp`, which accelerate alone turns into DDP on CPU) and ZeRO-3, and with gradient accumulation. Each run starts
with a line naming the distributed type and each process's parameter bytes; FSDP2's output loads as our own class."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llama_moe.training.checkpoint import HISTORY_FILE

REPO = Path(__file__).parents[2]
RECIPE = REPO / "recipes" / "continual_pretrain.py"
FSDP2 = ["--fsdp", "--fsdp_config", str(REPO / "recipes" / "accelerate" / "fsdp2_trainer.json")]
ZERO3 = REPO / "recipes" / "accelerate" / "ds_zero3.json"
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed (pip install deepspeed)"
)
PLACEMENT = re.compile(r"Distributed type (\w+), (\d) process\(es\); parameter bytes of [\d.]+ MiB: (.*)")
# SGD: float-noise differences in gradients that are nearly zero stay nearly zero (AdamW's first steps turn them
# into +-lr, which no tolerance on the weights could cover). Observed: at most 3e-6 apart.
ATOL = 2e-5


def _run(tiny_moe_path, domains, output: Path, processes: int, batch: int, *extra: str) -> dict:
    flags = ["--model_name_or_path", str(tiny_moe_path), "--domains", *(f"{n}={p}" for n, p in domains.items())]
    flags += ["--seq_len", "32", "--eval_blocks", "2", "--max_steps", "3", "--per_device_train_batch_size", str(batch)]
    flags += ["--optim", "sgd", "--learning_rate", "3e-2", "--warmup_steps", "0", "--seed", "0", "--logging_steps", "1"]
    flags += ["--save_strategy", "no", "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true"]
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        flags += ["--ddp_backend", "gloo"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [*launcher, str(RECIPE), *flags, *extra, "--output_dir", str(output)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    kind, world, shares = PLACEMENT.search(result.stderr).groups()
    log = json.loads((output / "trainer_log.json").read_text())
    return {
        "kind": kind,
        "shares": [int(share) for share in re.findall(r"\((\d+)%\)", shares)],
        "losses": [line["loss"] for line in log if "loss" in line],
        "weights": load_file(output / "model.safetensors"),
        "output": output,
    }


@pytest.fixture(scope="module")
def runs(tiny_moe_path, domains, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("distributed")
    runs = {
        "one": _run(tiny_moe_path, domains, root / "one", 1, 4),
        "accumulated": _run(tiny_moe_path, domains, root / "accumulated", 1, 2, "--gradient_accumulation_steps", "2"),
        "ddp": _run(tiny_moe_path, domains, root / "ddp", 2, 2),
        "fsdp2": _run(tiny_moe_path, domains, root / "fsdp2", 2, 2, *FSDP2),
    }
    if importlib.util.find_spec("deepspeed"):  # ZeRO-3 builds the model partitioned inside from_pretrained
        runs["zero3"] = _run(tiny_moe_path, domains, root / "zero3", 2, 2, "--deepspeed", str(ZERO3))
    return runs


def test_training_moves_the_weights_well_beyond_the_tolerance(runs, tiny_moe_path):
    source = load_file(tiny_moe_path / "model.safetensors")
    assert max((runs["one"]["weights"][k] - v).abs().max().item() for k, v in source.items()) > 100 * ATOL


def test_each_run_says_how_the_model_is_spread(runs):
    assert (runs["one"]["kind"], runs["one"]["shares"]) == ("NO", [100])
    assert (runs["ddp"]["kind"], runs["ddp"]["shares"]) == ("MULTI_CPU", [100, 100])
    assert json.loads((runs["ddp"]["output"] / HISTORY_FILE).read_text())[0]["world_size"] == 2
    assert runs["fsdp2"]["kind"] == "FSDP"
    assert all(45 <= share <= 55 for share in runs["fsdp2"]["shares"]), runs["fsdp2"]["shares"]  # really sharded


@needs_deepspeed
def test_zero3_partitions_the_model_on_cpu_processes(runs):
    """ZeRO-3's `zero.Init` inside from_pretrained saw one process on CPU (DeepSpeed's comm was never started) and
    refused the batch sizes; now each rank holds half of the parameter bytes."""
    assert runs["zero3"]["kind"] == "DEEPSPEED"
    assert all(45 <= share <= 55 for share in runs["zero3"]["shares"]), runs["zero3"]["shares"]


@pytest.mark.parametrize("name", ["accumulated", "ddp", "fsdp2", pytest.param("zero3", marks=needs_deepspeed)])
def test_same_training_as_one_process(runs, name):
    """The balance loss is on (the recipe's 0.01): before its weight was fixed, it grew with the processes and the
    accumulation steps, and the losses of these runs were 0.02 above the one-process run's."""
    one, other = runs["one"], runs[name]
    torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=0.0)
    for key, value in one["weights"].items():
        torch.testing.assert_close(other["weights"][key], value, rtol=0.0, atol=ATOL, msg=key)


def test_fsdp2_output_is_our_model(runs):
    """fully_shard makes the model an `FSDPLlamaMoEForCausalLM` defined in torch; saved as that, the folder held
    torch's files as its code and an `auto_map` naming them."""
    output = runs["fsdp2"]["output"]
    auto_map = json.loads((output / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_llama_moe.LlamaMoEForCausalLM"
    assert not list(output.glob("_fsdp*.py"))
    assert json.loads((output / "config.json").read_text())["architectures"] == ["LlamaMoEForCausalLM"]

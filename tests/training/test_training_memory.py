"""The training recipes' memory preflight (llama_moe/footprint.py, memory_check.py): the estimate adds up
its parts as documented, a run that will not fit is refused in one line naming flags that fit (before any model
loads), `--force true` runs anyway; and the recipes' checkpoint settings (`--save_steps` with `save_strategy: no`,
tied weights on resume). How close the estimate is to measured peaks: benchmarks/memory/training_memory.py."""

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest
from helpers import RECIPES, last_error_line, run_recipe
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.testing_utils import CaptureLogger

import llama_moe_hf  # noqa: F401  (registers the families)
from llama_moe.footprint import (
    GIB,
    RunSettings,
    activation_bytes,
    estimate_footprint,
    moe_config,
    parameter_counts,
)
from llama_moe.parsing import Parser
from llama_moe.training import memory_check
from llama_moe.training.resume import ResumableCheckpointsMixin, real_missing_keys

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks`
from benchmarks.memory.model_memory import smollm2_135m_config  # a published config, no download

ONE_K = RunSettings(batch=1, seq_len=1024, checkpointing=False)


def test_the_estimate_adds_up_weights_gradients_optimizer_and_activations():
    config = smollm2_135m_config()
    counts = parameter_counts(config)
    full = estimate_footprint(counts, counts.total, config, ONE_K)
    assert (full.weights, full.gradients, full.optimizer) == (4 * counts.total, 4 * counts.total, 8 * counts.total)
    assert full.total == pytest.approx(sum(dataclasses.astuple(full)))
    adafactor = estimate_footprint(counts, counts.total, config, dataclasses.replace(ONE_K, optimizer="adafactor"))
    assert adafactor.optimizer == 0 and adafactor.weights == full.weights
    partial = estimate_footprint(counts, counts.total // 4, config, ONE_K)  # e.g. the MoE blocks only
    assert (partial.gradients, partial.optimizer) == (full.gradients / 4, full.optimizer / 4)
    checkpointed = activation_bytes(config, dataclasses.replace(ONE_K, checkpointing=True))
    assert checkpointed < activation_bytes(config, ONE_K) / 2
    assert activation_bytes(config, dataclasses.replace(ONE_K, batch=4)) == 4 * activation_bytes(config, ONE_K)


def test_an_moe_costs_more_activations_per_token_than_its_dense_source():
    dense = smollm2_135m_config()
    moe = moe_config(dense, method="upcycle", num_experts=8, top_k=2)
    assert parameter_counts(moe).total > 4 * parameter_counts(dense).total
    assert activation_bytes(moe, ONE_K) > activation_bytes(dense, ONE_K)


def test_suggestions_keep_the_global_batch():
    settings = RunSettings(batch=8, seq_len=1024, checkpointing=False, accumulation=2)
    flags, fitting = memory_check.suggestions(lambda s: s.checkpointing and s.batch <= 2, settings)
    assert flags == [
        "--activation_checkpointing true",
        "--per_device_train_batch_size 2",
        "--gradient_accumulation_steps 8",
    ]
    assert fitting.batch * fitting.accumulation == 16
    assert memory_check.suggestions(lambda s: False, settings) is None


@pytest.fixture
def little_free_memory(monkeypatch):
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 0.5 * GIB)


def _pretraining(tiny_moe_path, domains, tmp_path) -> list[str]:
    argv = ["--config", str(RECIPES / "pretrain/llama-moe-v1.yaml"), "--model_name_or_path", str(tiny_moe_path)]
    argv += ["--domains", *(f"{name}={path}" for name, path in domains.items()), "--held_out_fraction", "0.2"]
    return argv + ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--seq_len", "32"]


def test_a_run_that_will_not_fit_is_refused_in_one_line_before_loading(
    tiny_moe_path, domains, tmp_path, capsys, no_model_loads, little_free_memory
):
    assert run_recipe("continual_pretrain.py", _pretraining(tiny_moe_path, domains, tmp_path)) == 2
    line = last_error_line(capsys)
    assert "this run needs about" in line and "0.5 GiB is free on this machine" in line
    assert line.endswith("or --force true to run anyway.")
    assert not (tmp_path / "out").exists()


def test_force_runs_anyway_and_a_run_that_fits_logs_its_estimate(tiny_moe_path, caplog, monkeypatch):
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 6 * GIB)
    values = {"per_device_train_batch_size": 64, "gradient_accumulation_steps": 1, "use_cpu": True}
    values = argparse.Namespace(**values, activation_checkpointing=False, force=False)
    with pytest.raises(ValueError, match="add --activation_checkpointing true --per_device_train_batch_size "):
        memory_check.check_memory(smollm2_135m_config(), values, 1024)
    memory_check.check_memory(smollm2_135m_config(), argparse.Namespace(**vars(values) | {"force": True}), 1024)
    with caplog.at_level("INFO", logger=memory_check.__name__):
        memory_check.check_memory(AutoConfig.from_pretrained(tiny_moe_path), values, 32)  # a tiny model fits
    assert "Estimated peak memory of one training process:" in caplog.text


def _save_settings(argv: list[str], tmp_path) -> TrainingArguments:
    (tmp_path / "no.yaml").write_text('save_strategy: "no"\n')
    argv = ["--config", str(tmp_path / "no.yaml"), "--output_dir", str(tmp_path / "out"), *argv]
    return Parser((TrainingArguments,)).parse_args_and_config(argv)[0]


def test_save_steps_given_while_the_file_says_no_turn_saving_on(tmp_path, capsys):
    assert _save_settings([], tmp_path).save_strategy == "no"
    training = _save_settings(["--save_steps", "3", "--save_total_limit", "2"], tmp_path)
    assert (training.save_strategy, training.save_steps, training.save_total_limit) == ("steps", 3, 2)
    assert "--save_steps and --save_total_limit given, so save_strategy is 'steps'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        _save_settings(["--save_steps", "3", "--save_strategy", "no"], tmp_path)
    assert exit.value.code == 2
    assert "--save_steps cannot go with --save_strategy no" in capsys.readouterr().err


def test_every_training_recipe_file_checkpoints_and_keeps_two():
    from llama_moe.parsing import read_config

    files = sorted((RECIPES / "pretrain").glob("*.yaml")) + sorted((RECIPES / "sft").glob("*.yaml"))
    for path in files:
        config = read_config(str(path))
        assert (config["save_strategy"], config["save_total_limit"]) == ("steps", 2), path


def test_tied_embeddings_are_not_reported_missing_on_resume(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "checkpoint-1")  # the LM head is the embedding: saved once
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    from transformers.trainer import logger

    for trainer_class, warned in [(Trainer, True), (type("Ours", (ResumableCheckpointsMixin, Trainer), {}), False)]:
        with CaptureLogger(logger) as captured:
            trainer_class(model=model, args=args)._load_from_checkpoint(str(tmp_path / "checkpoint-1"))
        assert ("There were missing keys" in captured.out) == warned, (trainer_class, captured.out)
    assert real_missing_keys(model, ["lm_head.weight"]) == []
    assert real_missing_keys(model, ["lm_head.weight", "model.norm.weight"]) == ["model.norm.weight"]
    both = ["lm_head.weight", "model.embed_tokens.weight"]
    assert real_missing_keys(model, both) == both  # neither was loaded


def test_zero_and_fsdp_shard_the_model_states():
    accelerate = RECIPES / "accelerate"
    strategies = [
        memory_check.sharding(argparse.Namespace(deepspeed=str(accelerate / "ds_zero3.json"))),
        memory_check.sharding(argparse.Namespace(deepspeed={"zero_optimization": {"stage": 2}})),
        memory_check.sharding(argparse.Namespace(fsdp=["full_shard"])),
        memory_check.sharding(argparse.Namespace()),
    ]
    assert strategies == ["zero3", "zero2", "fsdp2", "ddp"]
    config = smollm2_135m_config()
    counts = parameter_counts(config)
    whole = estimate_footprint(counts, counts.total, config, ONE_K)
    for strategy in ("zero3", "fsdp2"):
        sharded = estimate_footprint(
            counts, counts.total, config, dataclasses.replace(ONE_K, strategy=strategy, processes=8)
        )
        # ZeRO-3 keeps fp32 master weights beside the moments: 12 bytes a parameter, over 8 processes
        assert sharded.optimizer < whole.optimizer / 4 and sharded.total < whole.total


def test_the_free_memory_is_what_a_cgroup_leaves(tmp_path):
    """Under a memory cgroup the free memory is its limit less its usage: v2's files at the root, v1's in the
    process's group (the lowest of its own and its ancestors' limits); no limit is no cap."""
    from llama_moe.devices import _cgroup_free

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("3000000000\n")
    (v2 / "memory.current").write_text("1000000000\n")
    assert _cgroup_free(v2) == 2e9
    (v2 / "memory.max").write_text("max\n")
    assert _cgroup_free(v2) == float("inf")
    group = tmp_path / "v1" / "memory" / "docker" / "abc"
    group.mkdir(parents=True)
    membership = tmp_path / "cgroup"
    membership.write_text("9:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    (group / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (group / "memory.usage_in_bytes").write_text("500000000\n")
    (group / "memory.stat").write_text("cache 100\nhierarchical_memory_limit 2500000000\n")
    assert _cgroup_free(tmp_path / "v1", membership) == 2e9  # the parent's limit
    (group / "memory.stat").write_text("cache 100\nhierarchical_memory_limit 9223372036854771712\n")
    assert _cgroup_free(tmp_path / "v1", membership) == float("inf")


@pytest.mark.skipif(not Path("/sys/fs/cgroup/memory").is_dir(), reason="no cgroup-v1 memory controller")
def test_a_real_cgroup_limit_caps_the_free_memory(tmp_path):
    """A process moved into a child cgroup capped at 1 GiB sees under 1 GiB free (the forecast's and the calibration
    spill's free memory), where the controller lets this user make one."""
    import subprocess

    group = Path("/sys/fs/cgroup/memory") / f"llama-moe-test-{tmp_path.name}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(GIB))
    except OSError:
        pytest.skip("this user cannot make a memory cgroup")
    try:
        code = "from llama_moe.devices import available_bytes; print(available_bytes('cpu'))"
        enter = f'echo $$ > {group}/cgroup.procs && exec "{sys.executable}" -c "{code}"'
        free = float(subprocess.run(["bash", "-c", enter], capture_output=True, text=True, check=True).stdout)
        assert 0.5 * GIB < free < GIB
    finally:
        group.rmdir()

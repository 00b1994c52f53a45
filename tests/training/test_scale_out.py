"""Scale-out: two-process training (Trainer with DDP, ZeRO-2 and ZeRO-3 from recipes/accelerate's JSON files; FSDP2)
computes what one process computes; the accelerate and DeepSpeed configs load the way `accelerate launch` loads
them; the memory model's parameter counts and formulas."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SCALE_OUT_FAMILIES, scale_out_model

from llama_moe.footprint import STRATEGIES, ParameterCounts, estimate_memory, moe_config, parameter_counts

REPO = Path(__file__).parents[2]
sys.path.insert(0, str(REPO))  # `benchmarks`: the published configs and the memory table
from benchmarks.memory import memory_table
from benchmarks.memory.model_memory import llama2_7b_config, llama3_8b_config, smollm2_135m_config

CONFIGS = REPO / "recipes" / "accelerate"
SCRIPT = Path(__file__).parents[1] / "scripts" / "scale_out_script.py"
# Observed: at most 2e-6 relative between one process and two (float sums in another order, gloo all-reduce).
RTOL = 2e-5


# ---------------------------------------------------------------------------------------------------------------
# One process against two
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """scale_out_script.py once as one process and once under torchrun with two; what every rank wrote."""
    output = tmp_path_factory.mktemp("scale_out")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    # --standalone: a free rendezvous port, so a concurrent torchrun elsewhere on the machine cannot collide.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for launcher in ([sys.executable], torchrun):
        result = subprocess.run(
            [*launcher, str(SCRIPT), str(output)], env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
    names = ("world1-rank0", "world2-rank0", "world2-rank1")
    return {name: json.loads((output / f"{name}.json").read_text()) for name in names}


def assert_same_trajectory(two: dict, one: dict) -> None:
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(two[key]), torch.tensor(one[key]), rtol=RTOL, atol=0.0, msg=key)


def test_two_ranks_together_see_the_one_process_batches(runs):
    one, ranks = runs["world1-rank0"]["trainer"], [runs[f"world2-rank{r}"]["trainer"] for r in (0, 1)]
    assert len(one["batches"]) == len(ranks[0]["batches"]) == len(ranks[1]["batches"])
    for step, batch in enumerate(one["batches"]):
        assert ranks[0]["batches"][step] + ranks[1]["batches"][step] == batch, step


def test_trainer_ddp_matches_one_process(runs):
    one, two = runs["world1-rank0"]["trainer"], runs["world2-rank0"]["trainer"]
    assert (two["world_size"], two["distributed_type"]) == (2, "DistributedType.MULTI_CPU")
    assert one["losses"][-1] < one["losses"][0]  # it trains: a wrong update would show
    assert_same_trajectory(two, one)


@pytest.mark.parametrize("family", list(SCALE_OUT_FAMILIES))
def test_fsdp2_matches_one_process(runs, family):
    one, two = runs["world1-rank0"]["fsdp2"][family], runs["world2-rank0"]["fsdp2"][family]
    assert (one["parameter_class"], two["parameter_class"]) == ("Parameter", "DTensor")  # really sharded
    assert_same_trajectory(two, one)


needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed (pip install deepspeed)"
)
MOE_LEAVES = {"llama_moe": ["LlamaMoESparseMoeBlock"], "attn_moe": ["AttnMoEAttention"], "soap_moe": ["SoapMoEBlock"]}


@needs_deepspeed
def test_trainer_zero2_matches_one_process(runs):
    zero2 = runs["world2-rank0"]["zero2"]["llama_moe"]
    assert (zero2["distributed_type"], zero2["zero_stage"]) == ("DistributedType.DEEPSPEED", 2)
    assert_same_trajectory(zero2, runs["world1-rank0"]["trainer"])


@needs_deepspeed
@pytest.mark.parametrize("family", list(SCALE_OUT_FAMILIES))
def test_trainer_zero3_matches_one_process(runs, family):
    """ds_zero3.json as it is, through Trainer: parameters partitioned, the MoE blocks ZeRO-3 leaves (AttnMoE's
    routed attention too), and the one-process trajectory of the plain loop."""
    zero3 = runs["world2-rank0"]["zero3"][family]
    assert (zero3["distributed_type"], zero3["zero_stage"]) == ("DistributedType.DEEPSPEED", 3)
    assert zero3["partitioned_share"] > 0.95  # norms and routers, under the persistence threshold, stay whole
    assert zero3["leaf_modules"] == MOE_LEAVES[family]
    assert_same_trajectory(zero3, runs["world1-rank0"]["fsdp2"][family])


def test_plain_loop_is_trainers_update_rule(runs):
    """The FSDP2 comparison runs a hand-written loop (a plain Trainer cannot run FSDP on CPU; the recipes' trainers
    can: test_distributed_recipes.py); in one process it reproduces
    Trainer's trajectory, so FSDP2 = one process = Trainer. If Trainer's defaults change, update the loop."""
    one = runs["world1-rank0"]
    assert_same_trajectory(one["fsdp2"]["llama_moe"], one["trainer"])


# ---------------------------------------------------------------------------------------------------------------
# recipes/accelerate: loaded as `accelerate launch` loads them
# ---------------------------------------------------------------------------------------------------------------


def launch_environment(name: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file recipes/accelerate/NAME.yaml` gives the training processes
    (accelerate's own parsing and checks, up to the point where it would start them)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    argv = ["--config_file", str(CONFIGS / f"{name}.yaml"), "recipes/sft.py", "--config", "x.yaml"]
    args, defaults, mixed_precision_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
    if not args.use_deepspeed:
        return prepare_multi_gpu_env(args)
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)  # as accelerate's launch_command sets it
    return prepare_deepspeed_cmd_env(args)[1]


@pytest.mark.parametrize(
    "name, distributed_type", [("ddp", "MULTI_GPU"), ("zero2", "DEEPSPEED"), ("zero3", "DEEPSPEED"), ("fsdp2", "FSDP")]
)
def test_accelerate_config_loads(name, distributed_type):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert config.distributed_type.value == distributed_type
    # accelerate copies nested keys onto its launch arguments without checking them: a misspelt key is silently
    # ignored, so check each against the arguments `accelerate launch` has.
    known = {action.dest for action in launch_command_parser()._actions}
    for key in {**config.deepspeed_config, **config.fsdp_config}:
        assert key in known, f"{name}.yaml: {key} is not an `accelerate launch` argument"
    env = launch_environment(name)
    if config.deepspeed_config:
        assert (REPO / env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).is_file()


@pytest.fixture
def at_repo_root(monkeypatch):
    """The configs name files relative to the repository root, where the launch lines run."""
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("family", list(SCALE_OUT_FAMILIES))
def test_fsdp2_config_makes_each_decoder_layer_a_unit(monkeypatch, at_repo_root, family):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    for key, value in launch_environment("fsdp2").items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert (plugin.fsdp_version, plugin.reshard_after_forward, plugin.state_dict_type.name) == (
        2,
        True,
        "FULL_STATE_DICT",
    )
    model = scale_out_model(family)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    units = [name for name, module in model.named_modules() if policy(module)]
    assert units == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]


def test_fsdp2_trainer_json_matches_the_yaml(at_repo_root):
    """The torchrun line's `--fsdp --fsdp_config recipes/accelerate/fsdp2_trainer.json` sets what fsdp2.yaml sets."""
    from transformers import HfArgumentParser, TrainingArguments

    argv = ["--output_dir", "unused", "--fsdp", "--fsdp_config", "recipes/accelerate/fsdp2_trainer.json"]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    expected = dict(
        fsdp_version=2,
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT",
        cpu_ram_efficient_loading=True,
    )
    assert {key: args.fsdp_plugin_args[key] for key in expected} == expected


def deepspeed_config_as_trainer_fills_it(name: str, monkeypatch):
    """accelerate's DeepSpeedPlugin from the launch environment, its "auto" values filled as Trainer fills them
    (bf16 on, batch 4 x accumulation 2), checked by DeepSpeed's own config class."""
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    for key, value in launch_environment(name).items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()  # raises on settings accelerate refuses next to a DeepSpeed config file
    args = TrainingArguments(
        output_dir="unused", bf16=True, per_device_train_batch_size=4, gradient_accumulation_steps=2, use_cpu=True
    )
    filled = HfTrainerDeepSpeedConfig(dict(plugin.deepspeed_config))
    filled.trainer_config_process(args)
    filled.trainer_config_finalize(args, scale_out_model(), num_training_steps=10)
    return plugin, DeepSpeedConfig(filled.config)


@needs_deepspeed
@pytest.mark.parametrize("name, stage", [("zero2", 2), ("zero3", 3)])
def test_deepspeed_config_validates(monkeypatch, at_repo_root, name, stage):
    plugin, config = deepspeed_config_as_trainer_fills_it(name, monkeypatch)
    assert config.zero_optimization_stage == plugin.zero_stage == stage
    assert plugin.zero3_init_flag == (stage == 3)
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 2)
    assert config.bfloat16_config.enabled


@needs_deepspeed
@pytest.mark.parametrize("family", list(SCALE_OUT_FAMILIES))
def test_zero3_config_makes_the_moe_blocks_leaf_modules(monkeypatch, at_repo_root, family):
    """DeepSpeed's own leaf-module code with ds_zero3.json's settings: on a model of each family exactly its MoE
    blocks (one per layer) become ZeRO-3 leaves, and class names the model does not have are skipped."""
    from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config

    _, config = deepspeed_config_as_trainer_fills_it("zero3", monkeypatch)
    model = scale_out_model(family)
    leaves = apply_zero_leaf_module_config(model, config.zero_config.leaf_module)
    assert [type(module).__name__ for module in leaves] == MOE_LEAVES[family] * model.config.num_hidden_layers


# ---------------------------------------------------------------------------------------------------------------
# Memory model
# ---------------------------------------------------------------------------------------------------------------


def test_parameter_counts_of_published_models():
    # Published totals (the models' safetensors headers): the reference configs and the counter are right.
    assert parameter_counts(smollm2_135m_config()).total == 134_515_008
    assert parameter_counts(llama2_7b_config()).total == 6_738_415_616
    assert parameter_counts(llama3_8b_config()).total == 8_030_261_248


def test_parameter_counts_of_llama_moe_3_5b():
    """LLaMA-2-7B's FFNs cut into 16 experts, top-4: the FFN weights stay, routers are added, a quarter is active."""
    dense = llama2_7b_config()
    ffn = dense.num_hidden_layers * 3 * dense.hidden_size * dense.intermediate_size
    routers = dense.num_hidden_layers * 16 * dense.hidden_size
    counts = parameter_counts(moe_config(dense, method="random", num_experts=16, top_k=4))
    assert counts.total == 6_738_415_616 + routers  # 6.74 B, as the LLaMA-MoE-3.5B release says
    assert counts.active == 6_738_415_616 - ffn + ffn // 4 + routers  # 3.49 B
    assert counts.outside_layers == 2 * dense.vocab_size * dense.hidden_size + dense.hidden_size


def test_smollm2_reference_config_is_the_real_one(smollm2_path):
    real = json.loads((smollm2_path / "config.json").read_text())
    ours = smollm2_135m_config().to_dict()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert ours[key] == real[key], key
    for key in ("num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_parameters"):
        assert ours[key] == real[key], key


def test_memory_per_strategy():
    counts = ParameterCounts(total=1000, active=400, largest_layer=100, outside_layers=200)
    gathered = 2 * (200 + 2 * 100) + 2 * 200
    expected = {
        ("ddp", 1): 18 * 1000,
        ("ddp", 8): 22 * 1000,
        ("zero2", 8): 2 * 1000 + 14 * 1000 / 8,
        ("zero3", 8): 16 * 1000 / 8 + gathered,
        ("fsdp2", 8): 16 * 1000 / 8 + gathered,
    }
    for (strategy, num_gpus), total in expected.items():
        assert estimate_memory(counts, strategy, num_gpus).total == pytest.approx(total), strategy
    assert set(STRATEGIES) == {strategy for strategy, _ in expected}
    with pytest.raises(ValueError, match="Unknown strategy"):
        estimate_memory(counts, "zero4", 8)


def test_memory_table_prints_every_model_and_setting(capsys):
    memory_table.main([])
    out = capsys.readouterr().out
    assert out.count("### ") == 4
    rows = [line for line in out.splitlines() if line.startswith(("| DDP", "| ZeRO", "| FSDP2"))]
    assert len(rows) == 4 * len(STRATEGIES) * 3

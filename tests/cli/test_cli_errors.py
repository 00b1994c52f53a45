"""What a newcomer gets wrong, answered with one `error:` line and exit status 2 before any model is loaded: a
malformed or misspelt `--config` file, a model folder without a tokenizer, an output that cannot be written; and
`--help` texts that describe the flags as typed."""

import errno
import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import RECIPES, folder_hashes, last_error_line, one_error_line, run_recipe
from safetensors import SafetensorError

from llama_moe.checkpoints import folder
from llama_moe.checkpoints.writer import ShardedWriter
from llama_moe.commands import COMMANDS, main
from llama_moe.preflight import check_writable

RECIPE_FILES = {  # script: its recipe file
    "continual_pretrain.py": "pretrain/llama-moe-v1.yaml",
    "sft.py": "sft/stage1-general.yaml",
    "pretrain_soap.py": "pretrain/soap-small.yaml",
}
RECIPE_SCRIPTS = list(RECIPE_FILES)
OPTIONS_FILE_COMMANDS = {
    "convert",
    "export",
    "heal",
    "analyze",
    "eval",
    "batch-similar",
    "offline-data",
    "merge",
}  # dataclass options


# --config files ---------------------------------------------------------------------------------------------------

BAD_YAML = "output_dir: out\nnum_experts: [4\ntop_k: 2\n"  # the flow sequence is never closed


def test_malformed_config_names_the_file_and_line(tmp_path, capsys, no_model_loads):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_YAML)
    assert main(["convert", "--config", str(bad), "--output", str(tmp_path / "out")]) == 2
    assert one_error_line(capsys) == f"error: {bad}, line 3, column 6: not valid YAML: expected ',' or ']', but got ':'"
    for script in RECIPE_SCRIPTS:
        assert run_recipe(script, ["--config", str(bad)]) == 2
        assert f"{bad}, line 3, column 6: not valid YAML" in one_error_line(capsys)


@pytest.mark.parametrize(
    "argv, key, closest",
    [
        (["convert"], "num_expert", "num_experts"),
        (["convert"], "tasks", None),  # eval's option: a recipe file sets its own command's options only
        (["eval", "default"], "windw", "window"),
        (["export", "model", "--to", "mixtral"], "overwite", "overwrite"),
    ],
)
def test_unknown_config_key_names_it_and_the_closest_option(tmp_path, capsys, no_model_loads, argv, key, closest):
    config = tmp_path / "config.yaml"
    config.write_text(f"{key}: 1\n")
    assert main([*argv, f"--config={config}"]) == 2
    err = one_error_line(capsys)
    hint = f"; did you mean {closest!r}?" if closest else ""
    assert err.startswith(f"error: {config}: unknown option {key!r}{hint} (see llama-moe {argv[0]} --help)")
    assert "dataclass" not in err and "fail_with_unknown_args" not in err


@pytest.mark.parametrize(
    "script, key, closest",
    [("sft.py", "learning_rat", "learning_rate")]
    + [(script, "output_dirr", "output_dir") for script in ("continual_pretrain.py", "pretrain_soap.py")],
)
def test_recipes_name_an_unknown_config_key(tmp_path, capsys, script, key, closest):
    config = tmp_path / "config.yaml"
    config.write_text(f"{key}: 1\n")
    assert run_recipe(script, ["--config", str(config)]) == 2
    assert f"unknown option {key!r}; did you mean {closest!r}?" in one_error_line(capsys)


def test_config_of_a_command_without_options_file_is_refused(capsys):
    assert main(["push", "folder", "--repo-id", "a/b", "--config", "x.yaml"]) == 2
    assert "--config: this command takes no options file" in one_error_line(capsys)


def test_an_unknown_command_is_named(capsys):
    assert main(["mrege", "--config", "x.yaml"]) == 2
    assert one_error_line(capsys).startswith("error: unknown command 'mrege'; the commands are convert, merge, heal,")


# A dense folder without a tokenizer ---------------------------------------------------------------------------------


def test_folder_without_tokenizer_asks_for_one_before_loading_the_model(
    tiny_dense, tiny_calibration, tmp_path, capsys, monkeypatch
):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_dense[0] / name, bare / name)
    argv = ["convert", "--model", str(bare), "--method", "cluster", "--cluster-on", "activations", "--num-experts"]
    argv += ["4", "--top-k", "2", "--calibration-data", str(tiny_calibration), "--no-progress", "--no-eval"]
    with monkeypatch.context() as patch:
        patch.setattr(folder.FolderSource, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
        assert main([*argv, "--output", str(tmp_path / "out")]) == 2
    err = one_error_line(capsys)
    assert f"{bare} has no tokenizer" in err and "--tokenizer FOLDER_OR_HUB_ID" in err and "sentencepiece" not in err

    assert main([*argv, "--output", str(tmp_path / "out"), "--tokenizer", str(tiny_dense[0])]) == 0
    assert (tmp_path / "out" / "tokenizer.json").is_file()  # the given tokenizer goes with the model
    assert f"tokenizer: {tiny_dense[0].resolve()}\n" in (tmp_path / "out" / "moe_recipe.yaml").read_text()


# Outputs that cannot be written -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["convert", "--model", "MODEL", "--output", "OUT"], "--output"),
        (["convert", "--model", "MODEL", "--output", "{tmp}/ok", "--save-split", "OUT"], "--save-split"),
        (["export", "MODEL", "--to", "mixtral", "--output", "OUT"], "--output"),
        (["batch-similar", "--output", "OUT"], "--output"),
        (["offline-data", "--output", "OUT"], "--output"),
        (["analyze", "MODEL", "--output", "OUT"], "--output"),
        (["eval", "MODEL", "--output", "OUT"], "--output"),
    ],
)
def test_unwritable_output_is_refused_before_any_work(tiny_dense, tmp_path, capsys, no_model_loads, argv, flag):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "sub"  # under a file: refused even for root
    names = {"MODEL": str(tiny_dense[0]), "OUT": str(out)}
    assert main([names.get(arg, arg.format(tmp=tmp_path)) for arg in argv]) == 2
    expected = f"error: {flag} {out} cannot be written: {tmp_path / 'a-file'} is a file, not a folder."
    assert one_error_line(capsys) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_missing_calibration_file_is_refused_before_any_work(tiny_dense, tmp_path, capsys, no_model_loads):
    """Even for a method that reads no calibration data (upcycle): the file was named, so it is meant."""
    missing, out = tmp_path / "notes.txt", tmp_path / "out"
    argv = ["convert", "--model", str(tiny_dense[0]), "--output", str(out), "--calibration-data", str(missing)]
    assert main([*argv, "--method", "upcycle", "--num-experts", "2"]) == 2
    assert one_error_line(capsys) == f"error: Calibration data file {missing} does not exist."
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", RECIPE_SCRIPTS)
def test_recipes_refuse_an_unwritable_output_dir_before_training(tmp_path, capsys, script):
    (tmp_path / "a-file").write_text("")
    argv = ["--config", str(RECIPES / RECIPE_FILES[script]), "--output_dir", str(tmp_path / "a-file" / "out")]
    assert run_recipe(script, argv) == 2
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in one_error_line(capsys)


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="no /proc")
def test_writability_is_tried_not_read_from_permission_bits(tmp_path):
    with pytest.raises(PermissionError, match="creating an entry in /proc fails"):
        check_writable("/proc/llama-moe-out", "--output")  # /proc is r-x for all, yet root could "write" by the bits
    assert check_writable(tmp_path / "new" / "deeper", "--output") == tmp_path / "new" / "deeper"
    assert list(tmp_path.iterdir()) == []  # the trial entry is gone


# --help -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_describes_the_flags_as_typed(command, capsys):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: [])" not in text
    assert not re.search(r"--\w+_\w+", text)  # one spelling, the one the docs write: --num-experts, --no-eval
    for flag, help in re.findall(r"--no-([\w-]+)\s+(turn .*)", text):
        assert help == f"turn --{flag} off", (flag, help)
    assert ("--config FILE" in text) == (command in OPTIONS_FILE_COMMANDS)


def test_help_of_convert_and_push(capsys):
    assert main(["convert", "--help"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"\n  --no-progress\s+turn --progress off", text)
    assert re.search(r"\n  --no-eval\s+turn --eval off", text)
    assert "[--num-experts NUM_EXPERTS] [--top-k TOP_K]" in text
    assert re.search(r"--config FILE\s+a YAML file of these options", text)
    assert main(["push", "--help"]) == 0
    assert "Hugging Face token (default: the logged-in one)\n" in capsys.readouterr().out


@pytest.mark.parametrize("script", RECIPE_SCRIPTS)
def test_recipes_help_lists_config_and_negated_flags(script, capsys):
    assert run_recipe(script, ["--help"]) == 0
    text = capsys.readouterr().out
    # transformers' spelling, as its own scripts and TRL's show it
    assert "--config FILE" in text and re.search(r"\n  --no_log_on_each_node\s+turn --log_on_each_node off", text)
    assert "--per_device_train_batch_size" in text and "--per-device-train-batch-size" not in text


# Training-state and LoRA options of the recipes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("sft.py", ["--lora_train_routers", "true"], "lora_train_routers needs use_peft"),
        ("sft.py", ["--use_peft", "--lora_target_parameters", "mlp.experts.down_proj"], "needs lora_dropout: 0"),
        ("sft.py", ["--use_peft", "--lora_dropout", "0", "--distill", "gkd"], "LoRA is set up for distill: none"),
        ("continual_pretrain.py", ["--resume_from_checkpoint", "true"], "holds no complete checkpoint"),
        ("sft.py", ["--resume_from_checkpoint", "nowhere/checkpoint-3"], "not a complete checkpoint folder"),
        ("pretrain_soap.py", ["--resume_from_checkpoint", "x/checkpoint-3"], "give true or false"),
        ("pretrain_soap.py", ["--resume_from_checkpoint", "true"], "holds no checkpoint of either stage"),
        ("sft.py", ["--resume_from_checkpoint", "true", "--overwrite_output_dir", "true"], "cannot go with"),
        ("sft.py", ["--use_peft", "--lora_train_routers", "true", "--freeze_routers", "true"], "contradict"),
    ],
)
def test_resume_and_lora_mistakes_get_one_line(tmp_path, capsys, no_model_loads, script, flags, message):
    argv = ["--config", str(RECIPES / RECIPE_FILES[script]), "--output_dir", str(tmp_path / "out"), *flags]
    assert run_recipe(script, argv) == 2
    assert message in one_error_line(capsys)


@pytest.mark.parametrize("script", RECIPE_SCRIPTS)
@pytest.mark.parametrize(
    "flags, content, message",
    [
        (["--deepspeed", "{path}"], None, "--deepspeed {path}: cannot be read (No such file or directory)"),
        (["--deepspeed", "{path}"], '{"zero_optimization": {', "--deepspeed {path}: not valid JSON"),
        (["--fsdp", "--fsdp_config", "{path}"], "[1]", "--fsdp_config {path}: must hold a JSON object"),
        (["--fsdp", "--fsdp_config", "{path}"], '{"auto_wrap_policy": "NOPE"}', "`auto_wrap_policy` must be one of"),
    ],
)
def test_a_wrong_distributed_config_gets_one_line(tmp_path, capsys, no_model_loads, script, flags, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    flags = [flag.format(path=path) for flag in flags]
    argv = ["--config", str(RECIPES / RECIPE_FILES[script]), "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"]
    argv += flags
    if "deepspeed" in flags[0]:
        pytest.importorskip("deepspeed")
    assert run_recipe(script, argv) == 2
    assert message.format(path=path) in one_error_line(capsys)


def test_accelerates_deepspeed_config_file_is_checked(tmp_path, capsys, no_model_loads, monkeypatch):
    """`accelerate launch --config_file zero3.yaml` hands the DeepSpeed file over in the environment."""
    pytest.importorskip("deepspeed")
    path = tmp_path / "ds.json"
    path.write_text("{")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    argv = ["--config", str(RECIPES / RECIPE_FILES["sft.py"]), "--output_dir", str(tmp_path / "out")]
    assert run_recipe("sft.py", argv) == 2
    assert f"the accelerate config's deepspeed_config_file {path}: not valid JSON" in one_error_line(capsys)


# Broken files: a truncated shard, a missing shard, a line of data that is not JSON ---------------------------------


@pytest.fixture
def broken_moe(tiny_moe_path, tmp_path):
    """Copies of the tiny converted model: one with its weights cut in half, one sharded with a shard missing."""
    truncated, sharded = tmp_path / "truncated", tmp_path / "sharded"
    shutil.copytree(tiny_moe_path, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    shutil.copytree(tiny_moe_path, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    return {"truncated": truncated, "sharded": sharded}


@pytest.mark.parametrize("which, message", [("truncated", "corrupt or truncated"), ("sharded", "is missing")])
def test_broken_weights_get_one_line_in_every_command_and_recipe(broken_moe, tmp_path, capsys, which, message):
    folder = str(broken_moe[which])
    for argv in (["chat", folder, "--prompt", "hi"], ["info", folder], ["analyze", folder, "--output", "x"]):
        assert main(argv) == 2, argv
        assert message in one_error_line(capsys), argv
    flags = ["--model_name_or_path", folder, "--output_dir", str(tmp_path / "out")]
    for script in ("continual_pretrain.py", "sft.py"):
        assert run_recipe(script, ["--config", str(RECIPES / RECIPE_FILES[script]), *flags]) == 2
        assert message in one_error_line(capsys), script


def test_a_data_line_that_is_not_json_gets_one_line(tiny_moe_path, tmp_path, capsys, monkeypatch):
    (tmp_path / "data/offline/sft/chat").mkdir(parents=True)
    good = '{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}'
    (tmp_path / "data/offline/sft/chat/train.jsonl").write_text(f"{good}\n{{bad line\n")
    (tmp_path / "prose.jsonl").write_text('{"text": "hello"}\n{"text": broken\n')
    monkeypatch.chdir(tmp_path)
    common = ["--model_name_or_path", str(tiny_moe_path), "--output_dir", "out", "--use_cpu", "true"]
    argv = ["--config", str(RECIPES / "sft/stage1-general.yaml"), *common]
    assert run_recipe("sft.py", argv) == 2
    err = capsys.readouterr().err  # datasets' progress bar, then the error line
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "error: Cannot read the training data (chat/train.jsonl): JSON parse error"
    )
    assert run_recipe("continual_pretrain.py", ["--domains", "prose=prose.jsonl", *common]) == 2
    assert "prose.jsonl line 2 is not valid JSONL" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_larger_than_the_embeddings_is_refused(tiny_dense, smollm2_path, tmp_path, capsys):
    argv = ["convert", "--model", str(tiny_dense[0]), "--tokenizer", str(smollm2_path), "--output", str(tmp_path / "o")]
    assert main([*argv, "--method", "upcycle", "--num-experts", "2", "--no-progress"]) == 2
    assert "has 49,152 tokens, more than the 128 embeddings" in one_error_line(capsys)
    assert not (tmp_path / "o").exists()


# A disk that fills up during the write; a corrupt tokenizer -------------------------------------------------------


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_disk_that_fills_up_during_conversion_leaves_nothing(tiny_dense, tmp_path, capsys, monkeypatch):
    """The weights' write fails half-way (checked by hand on a 300 KB tmpfs too: the code files' copy fails first
    there, with the same result)."""
    source = tiny_dense[0]
    before = folder_hashes(source)
    monkeypatch.setattr(ShardedWriter, "add", _disk_full)
    assert main(["convert", "--model", str(source), "--output", str(tmp_path / "out"), "--num-experts", "4"]) == 2
    assert "No space left on device" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == [] and folder_hashes(source) == before


def test_a_disk_that_fills_up_at_the_final_save_leaves_nothing(tiny_moe_path, domains, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (seen on a 300 KB tmpfs), not an OSError."""
    import transformers.modeling_utils

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    argv = ["--model_name_or_path", str(tiny_moe_path), "--domains", f"prose={domains['prose']}", "--seq_len", "32"]
    argv += ["--max_steps", "1", "--eval_blocks", "2", "--use_cpu", "true", "--report_to", "none"]
    argv += ["--save_strategy", "no", "--output_dir", str(tmp_path / "out")]
    assert run_recipe("continual_pretrain.py", argv) == 2
    assert "No space left on device" in last_error_line(capsys)  # after the training's progress bars
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def corrupt_tokenizer(tiny_moe_path, tmp_path):
    """The tiny converted model with its tokenizer.json cut short."""
    model = tmp_path / "model"
    shutil.copytree(tiny_moe_path, model)
    data = (model / "tokenizer.json").read_text()
    (model / "tokenizer.json").write_text(data[: len(data) // 2])
    return model


def test_a_corrupt_tokenizer_gets_one_line_naming_it(corrupt_tokenizer, tmp_path, capsys, monkeypatch):
    message = f"Cannot read the tokenizer of {corrupt_tokenizer}"
    (tmp_path / "data/offline/sft/chat").mkdir(parents=True)  # the SFT recipe's data, relative to the working folder
    chat = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    (tmp_path / "data/offline/sft/chat/train.jsonl").write_text(json.dumps(chat) + "\n")
    monkeypatch.chdir(tmp_path)
    assert main(["chat", str(corrupt_tokenizer), "--prompt", "hi"]) == 2
    assert message in one_error_line(capsys)
    flags = ["--model_name_or_path", str(corrupt_tokenizer), "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"]
    for script in ("continual_pretrain.py", "sft.py"):
        assert run_recipe(script, ["--config", str(RECIPES / RECIPE_FILES[script]), *flags]) == 2
        assert message in last_error_line(capsys), script  # after datasets' progress bar (SFT)

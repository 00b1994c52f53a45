"""`llama-moe` command line: convert / info / push / chat, and clean `error:` exits on bad input."""

import json
import subprocess
import sys

import pytest
import yaml
from helpers import FakeHfApi

from llama_moe.commands import main
from llama_moe.hub import push as hub


@pytest.fixture(scope="module")
def dense(tiny_dense):
    return tiny_dense[0]


def test_convert_info_and_dry_run_push(tmp_path, dense, capsys):
    out = tmp_path / "moe"
    argv = [
        "convert",
        "--model",
        str(dense),
        "--output",
        str(out),
        "--method",
        "sequential",
        "--num-experts",
        "4",
        "--top-k",
        "2",
        "--num-shared-experts",
        "0",
        "--score-scale-factor",
        "1.5",
        "--moe-layers",
        "1",
        "--seed",
        "7",
        "--dtype",
        "bfloat16",
        "--router-init",
        "zero",
        "--no-progress",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["moe_layers"] == [1] and config["score_scale_factor"] == 1.5 and config["dtype"] == "bfloat16"
    recipe = config["conversion_info"]["recipe"]
    assert recipe | {"method": "sequential", "seed": 7, "router_init": "zero", "moe_layers": ["1"]} == recipe
    total_line = next(line for line in printed.splitlines() if line.startswith("total parameters"))
    active_line = next(line for line in printed.splitlines() if line.startswith("active parameters per token"))

    assert main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert total_line in info and active_line in info and "top-2" in info
    assert "method: sequential (Sequential: expert e takes the e-th contiguous block" in info  # from the registry

    assert main(["push", str(out), "--repo-id", "me/tiny-moe", "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert "Would upload" in dry and "model.safetensors" in dry and "library_name: transformers" in dry


def test_convert_push_to_hub_uses_the_hub_client(tmp_path, dense, capsys, monkeypatch):
    api = FakeHfApi()
    monkeypatch.setattr(hub, "HfApi", lambda token=None: api)
    argv = [
        "convert",
        "--model",
        str(dense),
        "--output",
        str(tmp_path / "moe"),
        "--method",
        "upcycle",
        "--num-experts",
        "2",
        "--push-to-hub",
        "--repo-id",
        "me/up",
        "--private",
        "--no-progress",
    ]
    assert main(argv) == 0
    assert [call[0] for call in api.calls] == ["create_repo", "create_commit"]
    assert 'from_pretrained("me/up"' in api.uploaded_readme
    assert "pushed: https://huggingface.co/me/tiny-moe/commit/abc" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-experts", "4", "--top-k", "9"], "error: --top-k must be between 1 and --num-experts=4"),
        (["--push-to-hub"], "error: --push-to-hub needs --repo-id"),
        (["--num-experts", "7"], "error: Cannot split an FFN of 96 neurons into 7 equal experts"),
    ],
)
def test_bad_input_exits_2_with_one_error_line(tmp_path, dense, capsys, args, message):
    out = tmp_path / "moe"
    assert main(["convert", "--model", str(dense), "--output", str(out), "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_recipe_file_with_flags_overriding_it(tmp_path, dense, tiny_calibration, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "method": "cluster",
                "cluster_on": "up",
                "num_experts": 4,
                "top_k": 1,
                "moe_layers": "last:1",
                "calibration_data": str(tiny_calibration),
                "model": str(dense),
                "dtype": "bfloat16",
            }
        )
    )
    out = tmp_path / "moe"
    assert main(["convert", "--config", str(recipe), "--top-k", "2", "--output", str(out), "--no-progress"]) == 0
    saved = yaml.safe_load((out / "moe_recipe.yaml").read_text())
    assert saved["top_k"] == 2 and saved["num_experts"] == 4 and saved["cluster_on"] == "up"  # the flag won
    assert saved["moe_layers"] == ["last:1"] and saved["dtype"] == "bfloat16" and saved["model"] == str(dense)
    assert json.loads((out / "config.json").read_text())["moe_layers"] == [1]
    recipe.write_text("method: random\nnot_a_setting: 3\n")
    assert main(["convert", "--config", str(recipe), "--output", str(tmp_path / "x")]) == 2
    assert "not_a_setting" in capsys.readouterr().err


def parsed_recipe(*flags, config=None):
    """The recipe `llama-moe convert FLAGS` builds (nothing converted)."""
    from llama_moe.commands import build_parser
    from llama_moe.commands.convert import recipe_and_run

    argv = ["convert", "--output", "out", *flags, *(["--config", str(config)] if config else [])]
    (args,) = build_parser().parse_args_and_config(argv)
    return recipe_and_run(args)[0]


@pytest.mark.parametrize("segment_length", [128, 256])  # 256 is SoapMoE's default: given, it counts all the same
def test_the_command_line_and_the_python_api_build_the_same_recipe(tmp_path, segment_length):
    from llama_moe.conversion.plan import resolve_recipe
    from llama_moe.conversion.recipe import MoERecipe

    flags = ("--family", "soap_moe", "--num-experts", "4", "--segment-length", str(segment_length))
    api = MoERecipe(family="soap_moe", num_experts=4, options={"segment_length": segment_length})
    assert parsed_recipe(*flags) == api
    assert resolve_recipe(parsed_recipe(*flags)) == resolve_recipe(api)
    config = tmp_path / "recipe.yaml"
    config.write_text(f"family: soap_moe\nnum_experts: 4\nsegment_length: {segment_length}\n")
    assert parsed_recipe(config=config) == api  # a recipe file's keys count as flags do


def test_the_merge_flags_are_the_merge_recipe_settings_as_declared():
    """`llama-moe merge`'s flags are MergeConfig's settings (names, defaults, help) and its run flags RunOptions'."""
    import dataclasses

    from llama_moe.commands.merge import MERGE_SETTINGS, RUN_SETTINGS, MergeFlags, MergeRun
    from llama_moe.conversion.settings import RunOptions
    from llama_moe.merging.config import MergeConfig

    def declared(cls, names):  # not the types: HfArgumentParser rewrites a dataclass's `X | None` field types
        return {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(cls) if f.name in names}

    assert declared(MergeFlags, MERGE_SETTINGS) == declared(MergeConfig, MERGE_SETTINGS)
    assert {"gate_mode", "experts_per_token", "hidden_token", "gate_tokens", "seed"} <= set(MERGE_SETTINGS)
    run = declared(RunOptions, RUN_SETTINGS)
    assert declared(MergeRun, RUN_SETTINGS) == run | {"output": (dataclasses.MISSING, run["output"][1])}  # needed


@pytest.mark.parametrize("given", [[], ["--experts-per-token", "2"]])  # 2 is the default: given, it counts
def test_a_merge_flag_overrides_the_file_whatever_its_value(tmp_path, given):
    from llama_moe.commands import build_parser
    from llama_moe.commands.merge import merge_config

    config = tmp_path / "merge.yaml"
    config.write_text("experts:\n  - source_model: a\n  - source_model: b\n  - source_model: c\nexperts_per_token: 3\n")
    (args,) = build_parser().parse_args_and_config(["merge", "--config", str(config), "--output", "out", *given])
    assert merge_config(args).experts_per_token == (2 if given else 3)


@pytest.mark.parametrize("flags", [("--segment-length", "256"), ("--attn-experts", "3")])
def test_an_option_of_a_family_not_chosen_is_refused_in_one_line(tmp_path, dense, capsys, flags):
    """The family is chosen (`--family`, the preset or recipe file), never guessed from the options set."""
    family = {"--segment-length": "soap_moe", "--attn-experts": "attn_moe"}[flags[0]]
    assert main(["convert", "--model", str(dense), "--output", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {flags[0]} is an option of the {family} family, not of llama_moe: add --family {family}."
    assert not (tmp_path / "out").exists()


def test_help_lists_the_registered_components(capsys):
    assert main(["convert", "--help"]) == 0
    text = capsys.readouterr().out
    for expected in (
        "construction methods:",
        "sharing-inter",
        "router initialisations:",
        "selector",
        "--cluster-on",
        "options of router initialisation 'selector'",
        "model families:",
        "attn_moe",
        "--attn-experts",
    ):
        assert expected in text, expected


def test_module_entry_point_in_a_subprocess(tmp_path, dense):
    existing = tmp_path / "existing"
    existing.mkdir()
    cmd = [sys.executable, "-m", "llama_moe", "convert", "--model", str(dense), "--output", str(existing)]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("error: Output folder") and "Traceback" not in run.stderr
    assert list(existing.iterdir()) == []


@pytest.mark.smoke
@pytest.mark.slow
def test_chat_with_converted_smollm2(tmp_path, smollm2_path):
    # Upcycled experts compute exactly the dense FFN, so the answer is the dense model's answer.
    out = tmp_path / "smol-moe"
    argv = [
        "convert",
        "--output",
        str(out),
        "--model",
        str(smollm2_path),
        "--method",
        "upcycle",
        "--num-experts",
        "2",
        "--top-k",
        "1",
        "--moe-layers",
        "0",
        "1",
        "--no-progress",
    ]
    assert main(argv) == 0
    # As the `llama-moe` console script runs it (`llama_moe`; the package registers the families when transformers
    # is imported): the folder must load without its remote code.
    chat = [sys.executable, "-m", "llama_moe", "chat", str(out), "--prompt", "What is the capital of France?"]
    run = subprocess.run([*chat, "--max-new-tokens", "12"], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout and "remote code" not in run.stderr

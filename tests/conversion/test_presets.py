"""`llama-moe convert --preset NAME`: the recipe files of recipes/convert/ by name, overridden by flags."""

import json
from pathlib import Path

import pytest
import yaml

from llama_moe.commands import build_parser, main
from llama_moe.commands.convert import expand_preset, recipe_and_run
from llama_moe.conversion.layer_patterns import parse_moe_layers
from llama_moe.conversion.recipe import BEST_PRESET, load_recipe, preset_names, preset_path, sparsity_presets

RECIPES = Path(__file__).parents[2] / "recipes" / "convert"


def parsed(argv: list[str]):
    """(recipe, run options) the command line gives for `llama-moe convert ARGV`."""
    (args,) = build_parser().parse_args_and_config(expand_preset(["convert", *argv]))
    return recipe_and_run(args)


def test_the_presets_are_the_recipe_files():
    assert preset_names() == sorted(path.stem for path in RECIPES.glob("*.yaml"))
    assert BEST_PRESET in preset_names()


@pytest.mark.parametrize("name", preset_names())
def test_a_preset_gives_exactly_its_recipe_files_settings(name):
    recipe, run = parsed(["--preset", name, "--output", "out"])
    file_recipe, file_run = load_recipe(preset_path(name))
    assert recipe == file_recipe
    assert run.dtype == file_run.get("dtype")
    assert parsed([f"--preset={name}", "--output", "out"])[0] == file_recipe


def test_flags_override_a_preset_wherever_they_stand():
    file_recipe, _ = load_recipe(preset_path(BEST_PRESET))
    for argv in (
        ["--preset", BEST_PRESET, "--top-k", "7", "--selector-steps", "10", "--output", "out"],
        ["--top-k", "7", "--selector-steps", "10", "--preset", BEST_PRESET, "--output", "out"],
    ):
        recipe, run = parsed(argv)
        assert recipe.top_k == 7 and recipe.options["selector_steps"] == 10 and run.output == "out"
        assert recipe.method == file_recipe.method and recipe.options["cluster_on"] == "activations"
        assert recipe.calibration_tokens == file_recipe.calibration_tokens


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "no-such-preset"], "invalid choice: 'no-such-preset'"),
        (["--preset", BEST_PRESET, "--config", "recipe.yaml"], "--preset and --config"),
        (["--config=recipe.yaml", "--preset", BEST_PRESET], "--preset and --config"),
    ],
)
def test_bad_presets_are_one_line_errors(argv, message, tmp_path, capsys):
    assert main(["convert", *argv, "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error
    assert not (tmp_path / "out").exists()


def test_help_lists_the_presets_and_names_the_measured_best(capsys):
    assert main(["convert", "--help"]) == 0
    text = capsys.readouterr().out
    assert f"use --preset {BEST_PRESET}" in " ".join(text.split())
    assert f"--preset {' / '.join(sparsity_presets())} " in " ".join(text.split())
    assert all(f"  {name} " in text for name in preset_names())


def test_the_best_preset_converts_with_its_settings(tiny_dense, tiny_calibration, tmp_path):
    """The preset on a tiny model, its calibration sizes overridden to fit: the output carries the preset's recipe."""
    out = tmp_path / "moe"
    small = ["--calibration-tokens", "512", "--calibration-samples", "512", "--calibration-seq-len", "32"]
    argv = ["convert", "--preset", BEST_PRESET, "--model", str(tiny_dense[0]), "--output", str(out), "--no-progress"]
    assert main([*argv, "--calibration-data", str(tiny_calibration), *small]) == 0
    saved = yaml.safe_load((out / "moe_recipe.yaml").read_text())
    expected = yaml.safe_load(preset_path(BEST_PRESET).read_text())
    assert {key: saved[key] for key in expected if not key.startswith("calibration")} == {
        key: value for key, value in expected.items() if not key.startswith("calibration")
    }
    assert saved["calibration_tokens"] == 512 and saved["calibration_samples"] == 512


@pytest.mark.parametrize("name", sparsity_presets())
def test_a_sparsity_preset_keeps_its_share_of_the_ffn_active(name):
    """`sparse-N`: N% of the FFN neurons active per token in the MoE layers, shared experts counted, and every layer
    converted but the first (kept dense: docs/quality.md, "The levers")."""
    recipe, _ = load_recipe(preset_path(name))
    share = (recipe.top_k + recipe.num_shared_experts) / (recipe.num_experts + recipe.num_shared_experts)
    assert share == int(name.removeprefix("sparse-")) / 100
    assert parse_moe_layers(recipe.moe_layers, 30) == list(range(1, 30)) and recipe.heal_tokens > 0


def test_help_gives_each_preset_its_latest_measured_figures(tmp_path, monkeypatch, capsys):
    """`--help` reads the presets' quality, speed and tasks from one results file (benchmarks/results/presets.jsonl)."""
    from llama_moe.conversion import recipe as recipe_module

    name = sparsity_presets()[0]
    own = "built-in corpus chat-mixed: 592 calibration prompts ..."  # the preset's calibration_data, as recorded
    rows = [
        {"kind": "quality", "preset": name, "ratio": {"tutorial": 9.0}, "convert_seconds": 60, "calibration": own},
        {"kind": "quality", "preset": name, "ratio": {"tutorial": 1.5, "licences": 1.25}, "convert_seconds": 1200}
        | {"calibration": own},
        {"kind": "speed", "preset": name, "runtime": "llama.cpp F16", "decode_ratio": 1.61},
        {"kind": "tasks", "preset": name, "share": {"offline_continuation": 0.934, "llama_moe_arithmetic": 1.071}}
        | {"calibration": own},
        {"kind": "quality", "preset": name, "ratio": {"tutorial": 1.1}, "calibration": "local file mix.jsonl (9 docs)"},
        {"kind": "tasks", "preset": name, "share": {"offline_continuation": 0.5}},  # before: the docstrings
    ]
    results = tmp_path / "presets.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.setattr(recipe_module, "PRESET_RESULTS", results)
    expected = (
        "perplexity vs dense: tutorial 1.50x, licences 1.25x; converted in 20 min; decodes 1.61x dense (llama.cpp F16); "
        "task accuracy vs dense: offline_continuation 93%, llama_moe_arithmetic 107%"
    )
    assert recipe_module.preset_measurements() == {name: expected}
    assert main(["convert", "--help"]) == 0
    assert f"Measured (benchmarks/results/presets.jsonl): {expected}." in " ".join(capsys.readouterr().out.split())
    assert recipe_module.preset_measurements(tmp_path / "missing.jsonl") == {}

"""Recipes and registries: a component registered in a few lines is usable from the command line and a recipe file
and shows in the card and `info`; settings are checked in one place; a saved recipe rebuilds byte-identical weights."""

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from helpers import assert_same_logits, folder_hashes, load_moe, tiny_llama_config
from transformers import AutoModelForCausalLM

from llama_moe.commands import main
from llama_moe.conversion.methods.base import SplitMethod
from llama_moe.conversion.plan import resolve_recipe
from llama_moe.conversion.registry import option
from llama_moe_hf import METHODS, MoERecipe, RunOptions, build_moe, convert_to_moe, load_recipe, save_recipe


@dataclasses.dataclass(frozen=True)
class StridedOptions:
    strided_reverse: bool = option(False, "number the experts from the last neuron")


@pytest.fixture
def strided():
    """A made-up construction method, registered the way a new module would register one."""

    @METHODS.register("strided")
    class Strided(SplitMethod):
        description = "Strided: expert e takes every E-th FFN neuron, starting at neuron e."
        Options = StridedOptions

        def split(self, layer_idx, dense, context):
            from llama_moe.conversion.experts import ExpertSplit

            experts, size = self.target.num_experts, self.dense_config.intermediate_size
            neurons = torch.arange(size).view(-1, experts).T  # [E, I / E]
            return ExpertSplit(neurons.flip(0) if self.options.strided_reverse else neurons)

    yield Strided
    METHODS.unregister("strided")


def test_a_registered_method_works_from_the_command_line_a_recipe_file_the_card_and_info(
    strided, tiny_dense, tmp_path, capsys
):
    dense_path, input_ids, reference = tiny_dense
    first, second = tmp_path / "first", tmp_path / "second"
    argv = [
        "convert",
        "--model",
        str(dense_path),
        "--method",
        "strided",
        "--strided-reverse",
        "--num-experts",
        "4",
        "--top-k",
        "4",
        "--router-init",
        "zero",
        "--no-progress",
    ]
    assert main([*argv, "--output", str(first)]) == 0
    recipe = yaml.safe_load((first / "moe_recipe.yaml").read_text())
    assert recipe["method"] == "strided" and recipe["strided_reverse"] is True and recipe["router_init"] == "zero"
    card = (first / "README.md").read_text()
    assert "`strided`: Strided: expert e takes every E-th FFN neuron" in card and "strided_reverse: true" in card
    assert main(["info", str(first)]) == 0
    assert "method: strided (Strided: expert e takes every E-th FFN neuron" in capsys.readouterr().out
    model = load_moe(first)
    assert main(["convert", "--config", str(first / "moe_recipe.yaml"), "--output", str(second), "--no-progress"]) == 0
    assert folder_hashes(first)["model.safetensors"] == folder_hashes(second)["model.safetensors"]
    with pytest.raises(AssertionError):  # 4 experts of 24 neurons, top-4 with uniform weights 1/4, scale 1
        assert_same_logits(model, load_moe(dense_path), input_ids)


def test_the_made_up_method_splits_as_declared(strided, tiny_dense):
    dense_path, input_ids, _ = tiny_dense
    dense = AutoModelForCausalLM.from_pretrained(dense_path).eval()
    moe = build_moe(
        dense,
        method="strided",
        strided_reverse=True,
        num_experts=4,
        top_k=4,
        router_init="zero",
        score_scale_factor=4.0,
    )
    gate_up = moe.model.layers[0].mlp.experts.gate_up_proj  # [E, 2m, H]: expert 0 holds neurons 3, 7, 11, ...
    assert torch.equal(gate_up[0, 0], dense.model.layers[0].mlp.gate_proj.weight[3])
    assert_same_logits(moe, dense, input_ids)


# ----------------------------------------------------------------------------------------------------------------
# Saved recipes rebuild the same bytes


@pytest.mark.parametrize(
    "fields",
    [
        dict(method="random", num_experts=4, top_k=2, dtype="bfloat16"),
        dict(
            method="cluster",
            cluster_on="activations",
            num_experts=4,
            top_k=3,
            router_init="selector",
            compensation=True,
            selector_steps=3,
        ),
        dict(method="residual", num_experts=3, num_shared_experts=1, top_k=1),
        dict(
            family="attn_moe",
            attn_experts=8,
            attn_top_k=4,
            attn_router_init="fit",
            mlp_moe=True,
            method="sharing-inter",
            num_experts=4,
            moe_layers="last:1",
        ),
    ],
    ids=["random", "gmoefication", "residual", "attention-and-mlp"],
)
def test_converting_again_from_the_saved_recipe_gives_byte_identical_weights(
    fields, tiny_dense, tiny_calibration, tmp_path
):
    dense_path = tiny_dense[0]
    calibration = dict(calibration_data=str(tiny_calibration), calibration_tokens=512, calibration_seq_len=32)
    first = convert_to_moe(dense_path, tmp_path / "first", progress=False, **calibration, **fields)
    recipe, run = load_recipe(first.output_dir / "moe_recipe.yaml")
    assert run["model"] == str(dense_path.resolve())
    again = convert_to_moe(run.pop("model"), tmp_path / "again", recipe, progress=False, **run)
    assert again.recipe == first.recipe
    hashes = folder_hashes(first.output_dir), folder_hashes(again.output_dir)
    weights = [name for name in hashes[0] if name.endswith(".safetensors")]
    assert weights and all(hashes[0][name] == hashes[1][name] for name in weights)
    assert hashes[0]["config.json"] == hashes[1]["config.json"]


def test_flags_over_a_saved_recipe_work_out_what_it_left_to_the_components(tiny_dense, tmp_path):
    """The saved recipe keeps the settings worked out from others (score scale N/k, router init) unset, so a flag
    that overrides the file gets them worked out again instead of inheriting values made for other settings."""
    first = convert_to_moe(tiny_dense[0], tmp_path / "first", method="random", num_experts=4, top_k=2, progress=False)
    saved = yaml.safe_load((first.output_dir / "moe_recipe.yaml").read_text())
    assert (saved["score_scale_factor"], saved["router_init"]) == (None, None)
    assert first.recipe.score_scale_factor == 2.0  # what was used: also in config.json's conversion_info
    recipe, run = load_recipe(first.output_dir / "moe_recipe.yaml")
    run.pop("model")
    top_1 = convert_to_moe(tiny_dense[0], tmp_path / "top-1", recipe, top_k=1, progress=False, **run)
    upcycled = convert_to_moe(tiny_dense[0], tmp_path / "upcycled", recipe, method="upcycle", progress=False, **run)
    assert top_1.recipe.score_scale_factor == 4.0 and upcycled.recipe.score_scale_factor == 1.0


def test_recipe_files_round_trip(tmp_path):
    recipe = MoERecipe(method="cluster", num_experts=4, options={"cluster_on": "up"})
    path = save_recipe(tmp_path / "r.yaml", recipe, RunOptions(model="org/x", dtype="float16"))
    loaded, run = load_recipe(path)
    assert loaded == recipe and run == {"model": "org/x", "revision": None, "dtype": "float16", "max_shard_size": "5GB"}
    assert MoERecipe.from_dict(recipe.to_dict()) == recipe
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="must hold a YAML mapping"):
        load_recipe(tmp_path / "bad.yaml")


# ----------------------------------------------------------------------------------------------------------------
# One place checks the settings (before anything is opened) and fills the defaults, changing nothing it is given


def test_defaults_are_resolved_without_changing_the_recipe_given():
    given = MoERecipe(method="residual", num_experts=7, num_shared_experts=1, top_k=1)
    resolved = resolve_recipe(given)
    assert given.router_init is None and given.options == {}  # untouched (and frozen)
    assert (resolved.family, resolved.router_init, resolved.router_type) == ("llama_moe", "kmeans", "top_k")
    assert resolved.score_scale_factor == 1.0  # the residual split's own default, not v1's N/k
    assert resolve_recipe(MoERecipe(method="random", num_experts=8, top_k=2)).score_scale_factor == 4.0
    selector = resolve_recipe(MoERecipe(router_init="selector"))
    assert (selector.router_type, selector.score_scale_factor) == ("selector", 1.0)
    assert selector.options == {"selector_steps": 100, "selector_objective": "listwise"}
    attention = resolve_recipe(MoERecipe(family="attn_moe", options={"attn_experts": 2}), tiny_llama_config())
    assert attention.family == "attn_moe" and attention.options["attn_top_k"] == 1
    assert attention.options["attn_score_scale_factor"] == 1.0 and attention.options["attn_router_init"] == "random"


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(method="nope"), "Unknown construction method 'nope'; choose one of"),
        (dict(method="attention_heads"), "builds attention experts, not mlp experts"),
        (
            dict(router_init="fit"),
            "'fit' cannot start mlp routers; choose one of analytical, kmeans, selector, linear_selector, random, uniform_random, zero",
        ),
        (dict(router_type="selector"), "A 'selector' router is made by router init selector, not 'random'"),
        (dict(router_init="selector", router_type="switch"), "makes a 'selector' router, not 'switch'"),
        (dict(method="upcycle", router_init="selector"), "needs a method that splits the FFN's neurons"),
        (dict(method="cluster", num_shared_experts=1), "not supported with method 'cluster'"),
        (dict(num_experts="8"), "num_experts must be <class 'int'>, got '8'"),
        (dict(top_k=9), "--top-k must be between 1 and --num-experts=8"),
        (dict(moe_layers="last"), "Cannot read the layer pattern term 'last'"),
        (dict(calibration_tokens=100), r"--calibration-tokens \(100\) must be at least one sequence \(256 tokens\)"),
        (
            dict(options={"cluster_on": "up"}),
            "--cluster-on applies to construction method 'cluster', which is not used",
        ),
        (dict(options={"nope": 1}), "Unknown option 'nope'"),
        (dict(method="cluster", options={"cluster_on": "down"}), "--cluster-on must be one of gate, up, both"),
        (dict(router_init="selector", options={"selector_steps": 1.5}), "selector_steps must be <class 'int'>"),
        (
            dict(num_experts=4, family="attn_moe", options={"attn_experts": 2}),
            "--num-experts shape an MLP MoE; add --mlp-moe",
        ),
        (
            dict(family="llama_moe", options={"attn_experts": 2}),
            "--attn-experts is an option of the attn_moe family, not of llama_moe: add --family attn_moe",
        ),
    ],
)
def test_impossible_recipes_are_refused_with_one_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        resolve_recipe(MoERecipe(**fields))


def test_refused_before_the_source_is_opened(tmp_path):
    with pytest.raises(ValueError, match="--cluster-on applies to construction method 'cluster'"):
        convert_to_moe(tmp_path / "not-even-there", tmp_path / "out", cluster_on="up")
    with pytest.raises(ValueError, match="Unknown recipe keys \\['colour'\\]"):
        convert_to_moe(None, tmp_path / "out", colour="blue")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "recipes" / "convert").glob("*.yaml")), ids=str)
def test_shipped_recipe_files_resolve_for_the_default_model(path, smollm2_path):
    from transformers import AutoConfig

    recipe, run = load_recipe(path)
    resolved = resolve_recipe(recipe, AutoConfig.from_pretrained(smollm2_path), RunOptions(**run))
    assert resolved.method == recipe.method and set(run) <= {"dtype"}

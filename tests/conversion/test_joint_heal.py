"""Joint healing (`--joint-heal-tokens N`): after the layer-wise pass, every layer trained together against the dense
model's next-token distributions. Closer to the dense model, recorded in the config, the recipe and the card, written
in place of the weights (nothing left beside them), the same model as built in memory, and checked settings."""

import json

import pytest
import torch
from helpers import load_moe, logits
from transformers import AutoModelForCausalLM, AutoTokenizer

from llama_moe.checkpoints.writer import read_shapes
from llama_moe.conversion.calibration import CalibrationContext
from llama_moe.conversion.healing.joint import distillation_loss, joint_heal_tokens
from llama_moe.conversion.recipe import MoERecipe
from llama_moe.text.corpus import stdlib_docstrings
from llama_moe_hf import build_moe, convert_to_moe

SPLIT = dict(method="random", num_experts=4, top_k=1, router_init="random", calibration_tokens=1024)
JOINT = dict(joint_heal_tokens=8192, joint_heal_lr=3e-3)  # 32 sequences of 256: 8 steps


def objective(folder, tiny_dense) -> float:
    """What joint healing minimises (LM loss and KL to the dense model, `healing.joint.distillation_loss`), on
    calibration-like text the conversion did not train on."""
    text = stdlib_docstrings()[40]
    input_ids = AutoTokenizer.from_pretrained(tiny_dense[0])(text, return_tensors="pt").input_ids[:, :256]
    dense = AutoModelForCausalLM.from_pretrained(tiny_dense[0], dtype=torch.float32).eval()
    with torch.no_grad():
        return distillation_loss(load_moe(folder), dense, input_ids)[0].item()


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_dense):
    root = tmp_path_factory.mktemp("joint")
    plain = convert_to_moe(tiny_dense[0], root / "plain", progress=False, eval=False, **SPLIT)
    healed = convert_to_moe(tiny_dense[0], root / "healed", progress=False, eval=False, **SPLIT, **JOINT)
    return plain.output_dir, healed.output_dir


def test_joint_healing_brings_the_model_closer_to_the_dense_one(converted, tiny_dense):
    plain, healed = converted
    assert objective(healed, tiny_dense) < 0.9 * objective(plain, tiny_dense)
    info = load_moe(healed).config.conversion_info["joint_healing"]
    assert info["tokens"] == 8192 and info["steps"] == 7 and info["lr"] == 3e-3  # the last batch held back
    assert {"held_out_kl_before", "held_out_kl_after"} <= set(info) and info["kl_weight"] == 0.5


def test_joint_healing_rewrites_the_weights_in_place_and_says_so(converted):
    plain, healed = converted
    assert read_shapes(healed) == read_shapes(plain)
    assert sorted(p.name for p in healed.iterdir()) == sorted(p.name for p in plain.iterdir())  # no staging folder
    assert "joint_heal_tokens: 8192" in (healed / "moe_recipe.yaml").read_text()
    assert "| All layers healed jointly | 8,192 calibration tokens" in (healed / "README.md").read_text()


def test_joint_healing_of_a_sharded_folder_leaves_exactly_its_shards(converted, tmp_path, tiny_dense):
    result = convert_to_moe(
        tiny_dense[0], tmp_path / "sharded", progress=False, eval=False, max_shard_size="100KB", **SPLIT, **JOINT
    )
    index = json.loads((result.output_dir / "model.safetensors.index.json").read_text())
    shards = {p.name for p in result.output_dir.glob("model-*.safetensors")}
    assert len(shards) > 1 and shards == set(index["weight_map"].values())
    torch.testing.assert_close(
        logits(load_moe(result.output_dir), tiny_dense[1]), logits(load_moe(converted[1]), tiny_dense[1])
    )


def test_build_moe_heals_jointly_as_the_conversion_does(converted, tiny_dense):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dense[0], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dense[0])
    built = build_moe(dense, tokenizer=tokenizer, **SPLIT, **JOINT)
    assert not built.training
    written = load_moe(converted[1])
    torch.testing.assert_close(logits(built, tiny_dense[1]), logits(written, tiny_dense[1]), rtol=1e-4, atol=1e-4)
    assert built.config.conversion_info["joint_healing"]["steps"] == 7


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(joint_heal_tokens=100), "--joint-heal-tokens"),
        (dict(joint_heal_tokens=-256), "--joint-heal-tokens"),
        (dict(joint_heal_tokens=256, joint_heal_lr=0.0), "--joint-heal-lr"),
        (dict(joint_heal_tokens=256, joint_heal_kl_weight=1.5), "--joint-heal-kl-weight"),
    ],
)
def test_joint_heal_settings_are_checked_before_the_source_is_read(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        convert_to_moe(tmp_path / "no-such-model", tmp_path / "out", progress=False, **SPLIT, **fields)


@pytest.mark.parametrize(
    ("heal_tokens", "rows"),
    [(0, range(0, 8)), (1024, range(4, 12)), (4096, range(0, 8))],  # the last: no calibration tokens left after it
)
def test_joint_healing_trains_on_the_tokens_after_the_layer_wise_heals(heal_tokens, rows):
    recipe = MoERecipe(heal_tokens=heal_tokens, joint_heal_tokens=2048)
    given = torch.arange(16 * 256).view(16, 256)
    context = CalibrationContext(recipe, load_model=None, input_ids=given)
    torch.testing.assert_close(joint_heal_tokens(context, recipe), given[rows.start : rows.stop])


def test_a_joint_stage_that_ends_further_from_the_dense_model_says_so(tiny_dense, tmp_path, caplog):
    diverging = dict(SPLIT, joint_heal_tokens=4096, joint_heal_lr=1.0, joint_heal_kl_weight=1.0)
    with caplog.at_level("WARNING"):
        result = convert_to_moe(tiny_dense[0], tmp_path / "moe", progress=False, eval=False, **diverging)
    info = load_moe(result.output_dir).config.conversion_info["joint_healing"]
    assert info["held_out_kl_after"] > info["held_out_kl_before"]
    assert "ended further from the dense model than it began" in caplog.text

"""Joint healing (`--joint-heal-tokens N`): after the layer-wise pass, every layer trained together against the dense
model's next-token distributions. Closer to the dense model, recorded in the config, the recipe and the card, written
in place of the weights (nothing left beside them), the same model as built in memory, and checked settings."""

import dataclasses
import json
import runpy
import shlex

import pytest
import torch
from helpers import RECIPES, load_moe, logits
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from llama_moe.checkpoints.writer import read_shapes
from llama_moe.conversion.calibration import CalibrationContext
from llama_moe.conversion.healing.joint import JOINT_TEXT, distillation_loss, joint_heal_tokens, write_joint_text
from llama_moe.conversion.recipe import MoERecipe
from llama_moe.text.corpus import stdlib_docstrings
from llama_moe.text.tokens import token_stream
from llama_moe.training.checkpoint import HISTORY_FILE
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


def test_a_joint_stage_left_to_a_training_run_writes_its_text_and_the_command_that_runs_it(
    converted, tiny_dense, tmp_path, monkeypatch, caplog
):
    """--defer-joint-heal: the layer-wise result (the weights of the folder converted without the stage), the stage's
    tokens as text, and the logged command: `recipes/pretrain/joint-heal.yaml`
    with the stage's steps, warm-up, learning rate and KL weight, which brings the model nearer the dense one."""
    plain, _ = converted
    with caplog.at_level("WARNING", logger="llama_moe.conversion.pipeline"):
        result = convert_to_moe(
            tiny_dense[0], tmp_path / "left", progress=False, eval=False, defer_joint_heal=True, **SPLIT, **JOINT
        )
    folder = result.output_dir
    assert load_file(folder / "model.safetensors").keys() == load_file(plain / "model.safetensors").keys()
    for name, tensor in load_file(folder / "model.safetensors").items():
        torch.testing.assert_close(tensor, load_file(plain / "model.safetensors")[name], rtol=0, atol=0)
    info = load_moe(folder).config.conversion_info
    assert "joint_healing" not in info
    assert info["joint_healing_deferred"] | {"documents": 0} == {
        "tokens": 8192,
        "sequences": 32,
        "documents": 0,
        "text": JOINT_TEXT,
    }
    documents = (folder / JOINT_TEXT).read_text().splitlines()
    assert len(documents) == info["joint_healing_deferred"]["documents"] > 1
    assert "The joint heal stage was not run here" in caplog.text
    assert f"`{JOINT_TEXT}`" in (folder / "README.md").read_text()
    command = shlex.split(result.next_command)
    assert command[:2] == ["python", "recipes/continual_pretrain.py"] and command[-2:] == ["--distill_alpha", "0.5"]
    assert result.next_command in caplog.text
    monkeypatch.chdir(RECIPES.parent)  # the command runs from the repository's root
    outcome = runpy.run_path(command[1])["main"](command[2:] + ["--use_cpu", "true", "--disable_tqdm", "true"])
    (stage,) = json.loads((outcome.output / HISTORY_FILE).read_text())
    assert outcome.output == tmp_path / "left-joint"
    assert stage["steps"] == 7 and stage["distillation"]["alpha"] == 0.5  # the last batch held back, as here
    assert objective(outcome.output, tiny_dense) < 0.95 * objective(plain, tiny_dense)


def test_a_joint_stage_that_will_not_fit_is_left_to_a_training_run(tiny_dense, tmp_path, monkeypatch, caplog):
    """Where the joint stage's forecast is over the free memory, the conversion leaves it to a training run, says so
    before it starts, and keeps the other stages' forecast; --force runs it here."""
    from llama_moe import footprint
    from llama_moe.conversion import forecast

    joint_heal = forecast._joint_heal
    large = lambda *args: dataclasses.replace(joint_heal(*args), peak=30 * footprint.GIB)  # noqa: E731
    monkeypatch.setattr(forecast, "_joint_heal", large)
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 20 * footprint.GIB)
    with caplog.at_level("WARNING", logger="llama_moe.conversion.pipeline"):
        result = convert_to_moe(tiny_dense[0], tmp_path / "moe", progress=False, eval=False, **SPLIT, **JOINT)
    assert "needs about 30.0 GiB and 20.0 GiB is free: this conversion writes the layer-wise result" in caplog.text
    assert result.next_command and (result.output_dir / JOINT_TEXT).is_file()
    forecast = load_moe(result.output_dir).config.conversion_info["forecast"]
    assert "joint heal" not in forecast["memory_gib"]
    result = convert_to_moe(
        tiny_dense[0], tmp_path / "moe", progress=False, eval=False, overwrite=True, force=True, **SPLIT, **JOINT
    )
    assert result.next_command is None and "joint_healing" in load_moe(result.output_dir).config.conversion_info


def test_the_joint_stage_text_reads_back_as_its_tokens(smollm2_path, real_text, tmp_path):
    """What the recipes' packing makes of the text (each document followed by EOS) is the stage's token stream, for
    the real tokenizer and chat-formatted text: the conversations and the prose between EOS tokens."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t[:200]}], tokenize=False) for t in real_text]
    documents = [text for pair in zip(chats[:40], real_text[40:80]) for text in pair]
    tokens = token_stream(documents, tokenizer, 8192).view(32, 256)
    written = write_joint_text(tmp_path / JOINT_TEXT, tokens, tokenizer)
    read = [json.loads(line)["text"] for line in (tmp_path / JOINT_TEXT).read_text().splitlines()]
    assert written == len(read) > 40
    torch.testing.assert_close(token_stream(read, tokenizer, 8192), tokens.flatten())

"""Dense source families other than LLaMA: what their attention and norms do is kept exactly. Each family's tiny
random model is built from its own config class (no download) with its distinctive features switched on; the
upcycled model and the every-expert-on split equal its logits, and greedy decoding with the cache (sliding windows
crossed) equals the dense model's."""

import json

import pytest
import torch
from helpers import (
    FAMILY_CONFIGS,
    WINDOW,
    assert_same_logits,
    load_as_remote_code,
    load_moe,
    one_error_line,
    save_tiny_source,
    token_batch,
)

from llama_moe.commands import main
from llama_moe.commands.info import info_lines
from llama_moe.source_families import SOURCE_FAMILIES
from llama_moe_hf import convert_to_moe

pytestmark = pytest.mark.smoke  # the output reuses the source families' transformers modules: every pinned release

EVERY_EXPERT = dict(method="random", num_experts=4, top_k=4, router_init="zero", score_scale_factor=4.0)


def test_every_registered_family_is_tested():
    assert set(FAMILY_CONFIGS) == set(SOURCE_FAMILIES)


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def source(request, tmp_path_factory):
    """(family, folder, dense model) of each family's tiny checkpoint."""
    family = request.param
    folder = tmp_path_factory.mktemp(family) / "dense"
    return family, folder, save_tiny_source(folder, family)


def convert(folder, out, **fields):
    return load_moe(convert_to_moe(folder, out, eval=False, progress=False, **fields).output_dir)


def test_upcycled_model_equals_the_dense_model(source, tmp_path):
    family, folder, dense = source
    moe = convert(folder, tmp_path / "moe", method="upcycle", num_experts=4, top_k=2)
    assert moe.config.source_model_type == family
    assert any(line.startswith(f"source family: {family} (") for line in info_lines(tmp_path / "moe"))
    assert f"| Source family | `{family}`: " in (tmp_path / "moe" / "README.md").read_text()
    assert moe.config.layer_types == dense.model.config.layer_types if family.startswith("qwen") else True
    assert type(moe.model.layers[0].self_attn) is type(dense.model.layers[0].self_attn)
    assert_same_logits(moe, dense, token_batch(length=12), atol=1e-5)


def test_every_expert_split_equals_the_dense_model_and_decodes_alike(source, tmp_path):
    family, folder, dense = source
    moe = convert(folder, tmp_path / "moe", **EVERY_EXPERT)
    input_ids = token_batch(length=12)
    assert_same_logits(moe, dense, input_ids, atol=1e-5)
    prompt = input_ids[:1, :4]
    greedy = dict(max_new_tokens=2 * WINDOW, do_sample=False, pad_token_id=0)
    assert torch.equal(moe.generate(prompt, **greedy), dense.generate(prompt, **greedy))


CALIBRATION = dict(calibration_tokens=256, calibration_seq_len=32)
# Calibrated methods and routers with every expert on and unit weights: still exactly the dense model
CALIBRATED_EVERY_EXPERT = {
    "carve": dict(method="carve", num_experts=3, num_shared_experts=1, top_k=3, router_init="analytical"),
    "g-moefication": dict(
        method="cluster",
        cluster_on="activations",
        num_experts=4,
        top_k=4,
        router_init="selector",
        selector_steps=5,
        compensation=True,
    ),  # fmt: skip
}


@pytest.mark.parametrize("recipe", list(CALIBRATED_EVERY_EXPERT))
def test_calibrated_methods_with_every_expert_on_equal_the_dense_model(source, recipe, tiny_calibration, tmp_path):
    family, folder, dense = source
    fields = dict(calibration_data=str(tiny_calibration), **CALIBRATION, **CALIBRATED_EVERY_EXPERT[recipe])
    assert_same_logits(convert(folder, tmp_path / "moe", **fields), dense, token_batch(length=12), atol=1e-5)


def test_healing_runs_on_every_source_and_never_makes_a_layer_worse(source, tiny_calibration, tmp_path):
    """(Adam's first steps at the default rate overshoot on some of these tiny random layers: those are kept.)"""
    family, folder, dense = source
    fields = dict(method="residual", num_experts=3, num_shared_experts=1, top_k=1, router_init="selector",
                  selector_steps=5, heal_tokens=256, heal_epochs=2)  # fmt: skip
    moe = convert(folder, tmp_path / "moe", calibration_data=str(tiny_calibration), **CALIBRATION, **fields)
    report = moe.config.conversion_info["healing"]
    assert report["error_after"] <= report["error_before"]
    assert set(report["kept_layers"]) <= {0, 1}  # the layers where training did not help kept their weights


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_soap_moe_and_remote_code_keep_the_source_attention(family, tmp_path):
    dense = save_tiny_source(tmp_path / "dense", family, seed=1)
    soap = convert(tmp_path / "dense", tmp_path / "soap", family="soap_moe", num_experts=2)
    input_ids = token_batch(length=12)
    assert_same_logits(soap, dense, input_ids, atol=1e-5)  # upcycled experts: any merge is the dense FFN
    module, remote = load_as_remote_code(tmp_path / "soap", input_ids)
    assert module.startswith("transformers_modules.")
    torch.testing.assert_close(remote, dense(input_ids).logits[0, -1].detach(), atol=1e-5, rtol=1e-4)


def test_phi3_fused_mlp_is_split_for_the_methods(source, tmp_path):
    family, folder, dense = source
    if family != "phi3":
        pytest.skip("the fused gate_up_proj is Phi-3's")
    moe = convert(folder, tmp_path / "moe", method="random", num_experts=4, top_k=2, moe_layers=["1"])
    gate_up = dense.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(moe.model.layers[0].mlp.gate_proj.weight, gate_up[:96])  # the dense layer, LLaMA's layout
    assert torch.equal(moe.model.layers[0].mlp.up_proj.weight, gate_up[96:])
    assert "qkv_proj" in dict(moe.model.layers[1].self_attn.named_children())


def test_attention_experts_need_llama_attention(source, tmp_path):
    family, folder, _ = source
    if family == "llama":
        pytest.skip("LLaMA attention heads do become experts")
    with pytest.raises(ValueError, match="turns LLaMA attention heads into experts"):
        convert_to_moe(folder, tmp_path / "moe", family="attn_moe", eval=False, progress=False)


def test_an_unsupported_architecture_is_one_line_naming_the_supported_ones(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["convert", "--model", str(folder), "--output", str(tmp_path / "out"), "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert "'gpt2' model" in line and ", ".join(SOURCE_FAMILIES) in line
    assert not (tmp_path / "out").exists()

"""`llama-moe export --to dense`: an upcycled model back as its source's dense model (loaded by transformers alone,
the dense logits), the merged FFN's weights for each `--dense-experts`, shared experts and dense layers, refusals."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import export_refusal, load_moe, logits, save_tiny_moe, save_tiny_source
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from llama_moe.export import export_model
from llama_moe.export.dense import calibration_tokens
from llama_moe_hf import convert_to_moe

UPCYCLE = dict(method="upcycle", num_experts=4, top_k=2, router_init="random", progress=False)
M = 96  # an upcycled expert's size: the dense FFN's

LOAD_WITHOUT_PACKAGE = """
import json, sys, torch
sys.modules["llama_moe_hf"] = sys.modules["llama_moe"] = None  # the export must not need this package
from transformers import AutoModelForCausalLM
folders, ids = json.loads(sys.argv[1]), torch.tensor(json.loads(sys.argv[2]))
result = {}
for folder in folders:
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), (folder, info)  # every weight in the files, nothing left over
    with torch.no_grad():
        result[folder] = [type(model).__name__, model.eval()(ids).logits.tolist()]
print(json.dumps(result))
"""


def load_elsewhere(folders: list, input_ids: torch.Tensor) -> dict:
    """folder -> (model class, logits), loaded with transformers' own classes in a process without this package."""
    argv = [json.dumps([str(f) for f in folders]), json.dumps(input_ids.tolist())]
    run = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_PACKAGE, *argv], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return {folder: (name, torch.tensor(values)) for folder, (name, values) in json.loads(run.stdout).items()}


@pytest.fixture(scope="module")
def noisy(tiny_dense, tmp_path_factory):
    """An upcycled model whose experts differ (upcycle_noise), and its checkpoint's tensors."""
    folder = tmp_path_factory.mktemp("noisy") / "moe"
    convert_to_moe(tiny_dense[0], folder, **UPCYCLE | dict(upcycle_noise=0.1))
    return folder, load_file(folder / "model.safetensors")


def test_an_upcycled_model_exports_as_its_dense_source(tiny_dense, tmp_path):
    """LLaMA and Qwen3 (q/k norms, a sliding-window layer) sources: stock config, transformers' own class, the
    dense model's logits."""
    dense, input_ids, dense_logits = tiny_dense
    expected = {}
    convert_to_moe(dense, tmp_path / "llama-moe", **UPCYCLE)
    result = export_model(tmp_path / "llama-moe", "dense", tmp_path / "llama", progress=False)
    expected[str(result.output_dir)] = ("LlamaForCausalLM", dense_logits)
    qwen3 = save_tiny_source(tmp_path / "qwen3-dense", "qwen3")
    convert_to_moe(tmp_path / "qwen3-dense", tmp_path / "qwen3-moe", eval=False, **UPCYCLE)
    result = export_model(tmp_path / "qwen3-moe", "dense", tmp_path / "qwen3", progress=False)
    expected[str(result.output_dir)] = ("Qwen3ForCausalLM", logits(qwen3, input_ids))
    assert len(result.notes) == 1 and "averaged" in result.notes[0]
    for folder, (model_class, target_logits) in load_elsewhere(list(expected), input_ids).items():
        config = json.loads((Path(folder) / "config.json").read_text())
        assert "auto_map" not in config and config["architectures"] == [model_class] == [expected[folder][0]]
        assert not any(name.endswith(".py") for name in os.listdir(folder))
        assert (target_logits - expected[folder][1]).abs().max() < 1e-5, folder


def test_uniform_is_the_experts_mean_and_an_index_picks_one_expert(noisy, tmp_path):
    folder, source = noisy
    gate_up, down = source["model.layers.1.mlp.experts.gate_up_proj"], source["model.layers.1.mlp.experts.down_proj"]
    uniform = load_file(export_model(folder, "dense", tmp_path / "u", progress=False).output_dir / "model.safetensors")
    torch.testing.assert_close(uniform["model.layers.1.mlp.gate_proj.weight"], gate_up[:, :M].mean(0))
    torch.testing.assert_close(uniform["model.layers.1.mlp.up_proj.weight"], gate_up[:, M:].mean(0))
    torch.testing.assert_close(uniform["model.layers.1.mlp.down_proj.weight"], down.mean(0))
    assert not torch.allclose(uniform["model.layers.1.mlp.gate_proj.weight"], gate_up[0, :M])  # the noise differs
    one = export_model(folder, "dense", tmp_path / "2", dense_experts="2", progress=False)
    assert "replaced by expert 2" in one.notes[0]
    one = load_file(one.output_dir / "model.safetensors")
    assert torch.equal(one["model.layers.1.mlp.gate_proj.weight"], gate_up[2, :M])
    assert torch.equal(one["model.layers.1.mlp.up_proj.weight"], gate_up[2, M:])
    assert torch.equal(one["model.layers.1.mlp.down_proj.weight"], down[2])
    assert not any(".mlp.gate.weight" in name or "experts" in name for name in one)


def test_router_weights_are_the_mean_routing_probabilities_of_the_calibration_tokens(noisy, tmp_path):
    """Each layer's router softmax over the calibration tokens, taken here from the routers' inputs in the model."""
    folder, source = noisy
    model = load_moe(folder)
    inputs = {}
    for layer in (0, 1):
        gate = model.model.layers[layer].mlp.gate
        gate.register_forward_hook(lambda module, args, out, layer=layer: inputs.setdefault(layer, []).append(args[0]))
    tokens = calibration_tokens(load_tokenizer(folder), seq_len=128)  # the tiny model's max_position_embeddings
    with torch.no_grad():
        model(tokens)
    result = export_model(folder, "dense", tmp_path / "router", dense_experts="router", progress=False)
    exported = load_file(result.output_dir / "model.safetensors")
    for layer in (0, 1):
        router = source[f"model.layers.{layer}.mlp.gate.weight"]
        weights = torch.cat(inputs[layer]).float().matmul(router.T).softmax(-1).mean(0)
        assert weights.max() - weights.min() > 0.02  # the random router prefers some experts
        gate = torch.tensordot(weights, source[f"model.layers.{layer}.mlp.experts.gate_up_proj"][:, :M], dims=1)
        torch.testing.assert_close(exported[f"model.layers.{layer}.mlp.gate_proj.weight"], gate)


def load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_shared_experts_follow_the_merged_expert_and_dense_layers_are_padded(tiny_dense, tmp_path):
    """Layer 1 MoE (3 experts of 24, one shared expert of 24, score scale 1.5): its FFN is the merged expert plus
    the shared expert; layer 0 dense (96): the merged layer is padded with zero neurons to 96."""
    moe = convert_to_moe(tiny_dense[0], tmp_path / "moe", method="random", num_experts=3, top_k=2,
                         num_shared_experts=1, moe_layers=["1"], progress=False).output_dir  # fmt: skip
    result = export_model(moe, "dense", tmp_path / "dense", progress=False)
    assert any("padded with zero neurons to 96 (sizes per layer: [96, 48])" in note for note in result.notes)
    exported = LlamaForCausalLM.from_pretrained(result.output_dir).eval()
    source, moe_model = load_file(moe / "model.safetensors"), load_moe(moe)
    assert exported.config.intermediate_size == 96
    assert torch.equal(exported.model.layers[0].mlp.down_proj.weight, source["model.layers.0.mlp.down_proj.weight"])
    scale = moe_model.config.layer_score_scale(1)
    assert scale == 1.5
    gate, up = source["model.layers.1.mlp.experts.gate_up_proj"].mean(0).chunk(2)
    down = source["model.layers.1.mlp.experts.down_proj"].mean(0) * scale
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
        expected += moe_model.model.layers[1].mlp.shared_experts(x)
        torch.testing.assert_close(exported.model.layers[1].mlp(x), expected, atol=1e-5, rtol=1e-5)
    padding = exported.model.layers[1].mlp.down_proj.weight[:, 48:]
    assert padding.shape == (64, 48) and not padding.any()


def test_refusals(tiny_dense, noisy, tmp_path, capsys):
    dense, out = tiny_dense[0], str(tmp_path / "out")
    attn = convert_to_moe(
        dense, tmp_path / "a", family="attn_moe", attn_experts=2, attn_top_k=1, progress=False
    ).output_dir
    soap = convert_to_moe(dense, tmp_path / "s", family="soap_moe", num_experts=2, progress=False).output_dir
    save_tiny_moe(tmp_path / "switch", router_type="switch")
    save_tiny_source(tmp_path / "phi3-dense", "phi3")
    phi3 = convert_to_moe(tmp_path / "phi3-dense", tmp_path / "phi3", num_experts=4, eval=False, progress=False)
    cases = [
        ([attn], "Cannot export this model to dense exactly: it is an AttnMoE model"),
        ([soap], "it is a SoapMoE model: its dense FFN is its experts merged with one prompt's routing weights"),
        ([tmp_path / "switch"], "router_type 'switch' does not renormalise the top-k probabilities"),
        ([phi3.output_dir], "its source is phi3 (a fused qkv_proj, partial RoPE)"),
        ([noisy[0], "--dense-experts", "4"], "--dense-experts must be uniform, router or an expert index from 0 to 3"),
        ([noisy[0], "--dense-experts", "mean"], "got 'mean'"),
    ]
    capsys.readouterr()  # the conversions' output
    for (folder, *flags), message in cases:
        error = export_refusal([str(folder), "--to", "dense", "--output", out, *flags], capsys)
        assert message in error, (folder, error)

"""`llama-moe export`: converted models in transformers' Mixtral and Qwen2-MoE (loaded without this package, same
logits) and in GGUF (read back with gguf, run by llama.cpp when llama-cpp-python is installed); refusals."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import (
    export_refusal,
    load_moe,
    logits,
    save_tiny_moe,
    save_tiny_source,
    tiny_llama,
    tiny_llama_config,
    tiny_moe,
)

from llama_moe.commands import main
from llama_moe.conversion.recipe import sparsity_presets
from llama_moe.export import export_model
from llama_moe.export.gguf import rope_permute
from llama_moe.source_families import dense_config_fields
from llama_moe_hf import LlamaMoEConfig, LlamaMoEForCausalLM, convert_to_moe

pytestmark = pytest.mark.smoke  # exports go through transformers' own MoE classes: checked on every pinned release

CALIBRATION = dict(calibration_tokens=256, calibration_seq_len=32)
BOTH = ("mixtral", "qwen2_moe")
# (name, convert_to_moe fields, targets it exports to): every construction method that can export
METHODS = [
    ("random", dict(method="random"), BOTH),
    ("sequential", dict(method="sequential"), BOTH),
    ("cluster", dict(method="cluster"), BOTH),
    ("sharing-inner", dict(method="sharing-inner", calibrate=True), BOTH),
    ("sharing-inter", dict(method="sharing-inter", calibrate=True), BOTH),
    ("upcycle", dict(method="upcycle", upcycle_noise=0.05), BOTH),
    ("residual", dict(method="residual", num_experts=3, num_shared_experts=1, calibrate=True), ("qwen2_moe",)),
    # no renormalisation, a dense layer and shared experts: Qwen2-MoE's norm_topk_prob=False and mlp_only_layers
    ("switch-dense-shared", dict(router_type="switch", moe_layers=["1"], num_shared_experts=2), ("qwen2_moe",)),
]

LOAD_WITHOUT_PACKAGE = """
import json, sys, torch
sys.modules["llama_moe_hf"] = sys.modules["llama_moe"] = None  # the export must not need this package
from transformers import AutoModelForCausalLM
folders, ids = json.loads(sys.argv[1]), torch.tensor(json.loads(sys.argv[2]))
result = {}
for folder in folders:
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, trust_remote_code=False, output_loading_info=True
    )
    assert not any(info.values()), (folder, info)  # every weight in the files, nothing left over
    with torch.no_grad():
        result[folder] = [type(model).__name__, model.eval()(ids).logits.tolist()]
print(json.dumps(result))
"""


def load_elsewhere(folders: list, input_ids: torch.Tensor) -> dict:
    """folder -> (model class, logits), loaded with transformers' own classes in a process without this package."""
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_WITHOUT_PACKAGE,
            json.dumps([str(f) for f in folders]),
            json.dumps(input_ids.tolist()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return {folder: (name, torch.tensor(values)) for folder, (name, values) in json.loads(run.stdout).items()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_dense, tiny_calibration):
    """name -> a tiny converted model folder, made by the real conversion API (4 experts, top-2 by default)."""
    root = tmp_path_factory.mktemp("converted")
    folders = {}
    for name, fields, _ in METHODS:
        fields = {"num_experts": 4, "top_k": 2, **fields}
        if fields.pop("calibrate", False):
            fields.update(calibration_data=str(tiny_calibration), **CALIBRATION)
        folders[name] = convert_to_moe(tiny_dense[0], root / name, progress=False, **fields).output_dir
    return folders


def test_every_method_exports_exactly_to_mixtral_and_qwen2_moe(converted, tiny_dense, tmp_path):
    input_ids = tiny_dense[1]
    exported = {}
    for name, _, targets in METHODS:
        for target in targets:
            result = export_model(converted[name], target, tmp_path / f"{name}-{target}", progress=False)
            assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= set(
                p.name for p in result.output_dir.iterdir()
            )
            exported[str(result.output_dir)] = (name, target)
    loaded = load_elsewhere(list(exported), input_ids)
    source_logits = {name: logits(load_moe(converted[name]), input_ids) for name, _, _ in METHODS}
    for folder, (name, target) in exported.items():
        model_class, target_logits = loaded[folder]
        assert model_class == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[target]
        difference = (target_logits - source_logits[name]).abs().max().item()
        assert difference < 1e-5, (name, target, difference)


@pytest.mark.parametrize("name", sparsity_presets())
def test_every_sparsity_preset_exports_exactly_to_qwen2_moe(name, tiny_dense, tiny_calibration, tmp_path):
    """`--preset sparse-N` on a tiny model (its calibration and healing sizes shrunk to fit), healed: its linear
    softmax top-k router, shared experts and score scale k are Qwen2-MoE's, the same logits in stock transformers."""
    small = ["--calibration-tokens", "512", "--calibration-samples", "512", "--calibration-seq-len", "32"]
    small += ["--heal-tokens", "256", "--heal-batch-tokens", "64", "--heal-epochs", "1", "--linear-selector-steps", "5"]
    out = tmp_path / "moe"
    argv = ["convert", "--preset", name, "--model", str(tiny_dense[0]), "--output", str(out), "--no-progress"]
    assert main([*argv, "--calibration-data", str(tiny_calibration), *small]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["router_type"] == "top_k" and not config["moe_compensation"]
    assert config["score_scale_factor"] == config["num_experts_per_tok"] > 0
    card = (out / "README.md").read_text()
    assert "Exports exactly to qwen2_moe, gguf." in card and "| `mixtral` | no: shared experts" in card
    gguf_file = export_model(out, "gguf", tmp_path / "gguf", progress=False).output_dir / "model.gguf"
    assert "ernie4_5-moe" in gguf_file.read_bytes()[:4096].decode("latin-1")  # llama.cpp's shared-expert graph
    exported = export_model(out, "qwen2_moe", tmp_path / "qwen2_moe", progress=False).output_dir
    model_class, target_logits = load_elsewhere([exported], tiny_dense[1])[str(exported)]
    assert model_class == "Qwen2MoeForCausalLM"
    torch.testing.assert_close(target_logits, logits(load_moe(out), tiny_dense[1]), atol=1e-5, rtol=0)


# (source family, its config overrides, convert fields, target): sources other than LLaMA exported to the stock
# family whose attention is theirs
SOURCE_EXPORTS = [
    ("qwen3", dict(use_sliding_window=False), dict(method="upcycle"), "qwen3_moe"),
    ("qwen3", dict(max_window_layers=0), dict(router_type="switch", moe_layers=["1"]), "qwen3_moe"),  # all windowed
    ("qwen2", {}, dict(method="upcycle"), "qwen2_moe"),  # real q/k/v biases, window in layer 1 only
    ("qwen2", {}, dict(num_experts=3, num_shared_experts=1, moe_layers=["0"]), "qwen2_moe"),
    ("mistral", {}, dict(method="upcycle"), "mixtral"),  # a window in every layer
    ("mistral", dict(sliding_window=None, head_dim=8), dict(num_experts=3, num_shared_experts=1), "qwen2_moe"),
]


def test_sources_export_exactly_to_the_stock_family_of_their_attention(tmp_path):
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    exported = {}
    for i, (family, overrides, fields, target) in enumerate(SOURCE_EXPORTS):
        save_tiny_source(tmp_path / f"dense{i}", family, seed=i, **overrides)
        fields = {"num_experts": 4, "top_k": 2, **fields}
        moe = convert_to_moe(tmp_path / f"dense{i}", tmp_path / f"moe{i}", eval=False, progress=False, **fields)
        result = export_model(moe.output_dir, target, tmp_path / f"{target}{i}", progress=False)
        exported[str(result.output_dir)] = logits(load_moe(moe.output_dir), input_ids)
    for folder, (model_class, target_logits) in load_elsewhere(list(exported), input_ids).items():
        assert (target_logits - exported[folder]).abs().max() < 1e-5, (folder, model_class)


def test_targets_give_every_reason_they_cannot_represent_a_source(tmp_path, capsys):
    cases = [
        ("qwen3", {}, dict(num_experts=3, num_shared_experts=1), "qwen3_moe", ["mixes sliding", "shared experts (1)"]),
        ("qwen3", {}, {}, "mixtral", ["its source is qwen3 (q/k RMS norms), and mixtral's attention is that of llama"]),
        ("phi3", {}, {}, "qwen2_moe", ["its source is phi3 (a fused qkv_proj, partial RoPE)"]),
        ("llama", {}, {}, "qwen2_moe", ["an o_proj bias (attention_bias)"]),
        ("llama", {}, {}, "qwen3_moe", ["its source is llama (LLaMA attention), and qwen3_moe's attention is that of"]),
        ("mistral", {}, {}, "gguf", ["its source is mistral", "attention is that of llama"]),
    ]
    for i, (family, overrides, fields, target, reasons) in enumerate(cases):
        save_tiny_source(tmp_path / f"dense{i}", family, seed=i, **overrides)
        fields = {"num_experts": 4, **fields}
        moe = convert_to_moe(tmp_path / f"dense{i}", tmp_path / f"moe{i}", eval=False, progress=False, **fields)
        moe = moe.output_dir
        capsys.readouterr()  # the tiny source's save progress
        error = export_refusal([str(moe), "--to", target, "--output", str(tmp_path / "out")], capsys)
        assert f"Cannot export this model to {target} exactly: " in error
        assert all(reason in error for reason in reasons), (error, reasons)


def test_per_layer_scales_switch_and_inference_only_routers(tmp_path):
    """Per-layer score scales fold into each layer's experts; switch maps to norm_topk_prob=False; noisy and
    expert-choice routers export as the top-k they compute at inference, with a note saying so."""
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    cases = {
        "scaled": (dict(score_scale_factor=[3.0, 0.5]), []),
        "noisy": (dict(router_type="noisy_top_k"), ["noisy_top_k"]),
        "expert-choice": (dict(router_type="expert_choice", num_experts_per_tok=1), ["expert_choice"]),
    }
    exported = {}
    for name, (fields, noted) in cases.items():
        model = save_tiny_moe(tmp_path / name, **fields)
        result = export_model(tmp_path / name, "mixtral", tmp_path / f"{name}-mixtral", progress=False)
        assert [router for router in noted if any(router in note for note in result.notes)] == noted
        assert len(result.notes) == len(noted)
        exported[str(result.output_dir)] = logits(model, input_ids)
    switch = save_tiny_moe(tmp_path / "switch", router_type="switch", num_experts_per_tok=3)
    export_model(tmp_path / "switch", "qwen2_moe", tmp_path / "switch-qwen", progress=False)
    config = json.loads((tmp_path / "switch-qwen" / "config.json").read_text())
    assert (config["norm_topk_prob"], config["shared_expert_intermediate_size"], config["qkv_bias"]) == (False, 1, True)
    exported[str(tmp_path / "switch-qwen")] = logits(switch, input_ids)
    for folder, (_, target_logits) in load_elsewhere(list(exported), input_ids).items():
        assert (target_logits - exported[folder]).abs().max() < 1e-5, folder


def gguf_fields(reader) -> dict:
    """Metadata of a GGUFReader as Python values (strings decoded, arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def test_gguf_layout_metadata_and_values(converted, tmp_path):
    import gguf
    from safetensors.torch import load_file

    result = export_model(converted["random"], "gguf", tmp_path / "gguf", dtype="bfloat16", progress=False)
    assert result.files == ["model.gguf"] and [p.name for p in result.output_dir.iterdir()] == ["model.gguf"]
    assert any("no vocabulary" in note for note in result.notes)  # the tiny model's character tokenizer
    reader = gguf.GGUFReader(result.output_dir / "model.gguf")
    fields = gguf_fields(reader)
    expected = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.expert_count": 4,
        "llama.expert_used_count": 2,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 24,  # the experts' size: llama.cpp sizes them by n_ff
        "llama.attention.head_count": 8,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 8,
        "llama.vocab_size": 128,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_BF16),
        "tokenizer.ggml.model": "none",
    }
    assert {key: fields[key] for key in expected} == expected
    tensors = {t.name: t for t in reader.tensors}
    per_layer = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"]
    per_layer += ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    names |= {f"blk.{i}.{kind}.weight" for i in range(2) for kind in per_layer}
    assert set(tensors) == names
    shapes = {"ffn_gate_exps": [64, 24, 4], "ffn_down_exps": [24, 64, 4], "ffn_gate_inp": [64, 4], "attn_k": [64, 16]}
    for kind, shape in shapes.items():  # GGUF lists dimensions innermost first
        assert tensors[f"blk.1.{kind}.weight"].shape.tolist() == shape
    bf16, f32 = gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F32
    assert (
        tensors["blk.0.ffn_up_exps.weight"].tensor_type == bf16 and tensors["blk.0.attn_q.weight"].tensor_type == bf16
    )
    assert {tensors[f"blk.0.{k}.weight"].tensor_type for k in ("attn_norm", "ffn_gate_inp")} == {f32}

    source = load_file(converted["random"] / "model.safetensors")
    f32_export = export_model(converted["random"], "gguf", tmp_path / "f32", progress=False).output_dir
    values = {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(f32_export / "model.gguf").tensors}
    q = source["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(values["blk.1.attn_q.weight"], rope_permute(q, 8))
    down = source["model.layers.1.mlp.experts.down_proj"]  # [E, H, m], score scale N/k = 2 folded in
    assert torch.equal(values["blk.1.ffn_down_exps.weight"], down * 2.0)
    assert torch.equal(values["blk.1.ffn_up_exps.weight"], source["model.layers.1.mlp.experts.gate_up_proj"][:, 24:])


def test_gguf_writes_shared_experts_and_leading_dense_layers_as_ernie_moe(tmp_path, capsys):
    """Shared experts (and dense layers before the MoE ones) go to llama.cpp's "ernie4_5-moe" graph: the experts and
    the shared experts each with their own width, the shared ones ungated, the score scale in the experts' down."""
    import gguf

    model = save_tiny_moe(tmp_path / "moe", num_experts=3, num_shared_experts=2, moe_layers=[1], score_scale_factor=2.0)
    result = export_model(tmp_path / "moe", "gguf", tmp_path / "gguf", progress=False)
    reader = gguf.GGUFReader(result.output_dir / "model.gguf")
    fields, arch = gguf_fields(reader), "ernie4_5-moe"
    expected = {
        "general.architecture": arch,
        f"{arch}.feed_forward_length": 96,  # the dense layers'
        f"{arch}.expert_feed_forward_length": 24,
        f"{arch}.expert_shared_feed_forward_length": 48,
        f"{arch}.expert_count": 3,
        f"{arch}.expert_used_count": 2,
        f"{arch}.leading_dense_block_count": 1,
        f"{arch}.interleave_moe_layer_step": 1,
    }
    assert {key: fields[key] for key in expected} == expected
    tensors = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    assert {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_shexp.weight"} <= set(tensors)
    assert not any(name.startswith("blk.0.ffn_") and "exps" in name for name in tensors)
    mlp = model.model.layers[1].mlp
    torch.testing.assert_close(tensors["blk.1.ffn_up_shexp.weight"], mlp.shared_experts.up_proj.weight.detach())
    torch.testing.assert_close(tensors["blk.1.ffn_down_exps.weight"], 2.0 * mlp.experts.down_proj.detach())
    save_tiny_moe(tmp_path / "late", num_experts=3, num_shared_experts=1, moe_layers=[0])  # layer 1 dense
    argv = [str(tmp_path / "late"), "--to", "gguf", "--output", str(tmp_path / "out")]
    capsys.readouterr()
    assert "dense layers [1]: llama.cpp's MoE graphs take dense layers only before" in export_refusal(argv, capsys)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope.update(high_freq_factor=4.0, original_max_position_embeddings=64)
    fields = {**dense_config_fields(tiny_llama_config()), "rope_parameters": rope}
    LlamaMoEForCausalLM(LlamaMoEConfig(**fields, num_experts=4, num_shared_experts=1)).save_pretrained(
        tmp_path / "llama3"
    )
    argv = [str(tmp_path / "llama3"), "--to", "gguf", "--output", str(tmp_path / "out")]
    capsys.readouterr()
    assert "ernie4_5-moe graph has no rope_freqs" in export_refusal(argv, capsys)


def test_gguf_q8_0_quantizes_the_matrices_with_ggufs_quantizer(converted, tmp_path):
    """`outtype q8_0`: matrices whose rows are a multiple of 32 in Q8_0 (within half a quantization step of the F32
    export, plus the rounding of the F16 block scale), the others (the experts' down projection, rows of m = 24) in
    F16; norms and routers stay F32."""
    import gguf

    exported = {
        outtype: gguf.GGUFReader(
            export_model(converted["random"], "gguf", tmp_path / outtype, outtype=outtype, progress=False).output_dir
            / "model.gguf"
        )
        for outtype in ("auto", "q8_0")
    }
    assert gguf_fields(exported["q8_0"])["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    reference = {t.name: np.array(t.data) for t in exported["auto"].tensors}
    types = gguf.GGMLQuantizationType
    expected_types = {"attn_q": types.Q8_0, "ffn_up_exps": types.Q8_0, "ffn_down_exps": types.F16}
    expected_types |= {"attn_norm": types.F32, "ffn_gate_inp": types.F32}
    for tensor in exported["q8_0"].tensors:
        kind = tensor.name.split(".")[-2]
        if kind in expected_types:
            assert tensor.tensor_type == expected_types[kind], tensor.name
        values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(reference[tensor.name].shape)
        step = np.abs(reference[tensor.name]).max() / 127
        assert np.abs(values - reference[tensor.name]).max() <= 0.6 * step + 1e-6, tensor.name


def test_gguf_takes_the_dense_source_as_llama_cpp_writes_llama(tiny_dense, tmp_path):
    """The dense model through the same writer (for like-for-like llama.cpp comparisons): no expert metadata, n_ff
    the dense FFN's, its FFN as ffn_gate/up/down with the source's values; Mixtral still refuses it."""
    import gguf
    from safetensors.torch import load_file

    dense = tiny_dense[0]
    result = export_model(dense, "gguf", tmp_path / "gguf", progress=False)
    reader = gguf.GGUFReader(result.output_dir / "model.gguf")
    fields = gguf_fields(reader)
    assert fields["llama.feed_forward_length"] == 96 and "llama.expert_count" not in fields
    values = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    source = load_file(dense / "model.safetensors")
    assert torch.equal(values["blk.1.ffn_gate.weight"], source["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(values["blk.0.ffn_down.weight"], source["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(values["blk.0.attn_k.weight"], rope_permute(source["model.layers.0.self_attn.k_proj.weight"], 2))
    assert not any("exps" in name or "gate_inp" in name for name in values)
    with pytest.raises(ValueError, match="not a converted LlamaMoE checkpoint"):
        export_model(dense, "mixtral", tmp_path / "mixtral", progress=False)


@pytest.mark.parametrize("dtype", ["int8", "bf16"])
def test_an_unknown_dtype_is_refused_before_anything_is_read_or_written(tmp_path, dtype):
    with pytest.raises(ValueError, match=f"Unknown dtype '{dtype}'; choose one of float32, bfloat16, float16"):
        export_model(tmp_path / "no-such-model", "mixtral", tmp_path / "out", dtype=dtype, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def save_tiny_dense_bpe(path, vocab_size: int = 264):
    """A tiny dense LLaMA with a byte-level BPE tokenizer (256 bytes, one merge, two special tokens) whose
    vocabulary is smaller than the model's, as llama.cpp's converter pads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    vocab["\u0120t"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [("\u0120", "t")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    tiny_llama(vocab_size=vocab_size).save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_gguf_tokenizer_metadata(tmp_path):
    import gguf

    save_tiny_dense_bpe(tmp_path / "dense")
    convert_to_moe(tmp_path / "dense", tmp_path / "moe", method="upcycle", num_experts=2, progress=False)
    result = export_model(tmp_path / "moe", "gguf", tmp_path / "gguf", tokenizer_pre="smollm", progress=False)
    assert result.notes == []
    fields = gguf_fields(gguf.GGUFReader(result.output_dir / "model.gguf"))
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "smollm")
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 264 and tokens[256:259] == ["\u0120t", "<|im_start|>", "<|im_end|>"]
    control, unused = int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNUSED)
    assert types[257:259] == [control, control] and tokens[259] == "[PAD259]" and set(types[259:]) == {unused}
    assert fields["tokenizer.ggml.merges"] == ["\u0120 t"]
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (257, 258)
    assert fields["tokenizer.chat_template"].startswith("{% for m in messages %}")
    default = export_model(tmp_path / "moe", "gguf", tmp_path / "default", progress=False)
    assert any("tokenizer.ggml.pre is 'default'" in note for note in default.notes)


def test_llama_cpp_runs_the_gguf_like_transformers(tmp_path):
    """llama.cpp's logits equal the LlamaMoE model's, with per-layer score scales and llama3 RoPE (rope_freqs), the
    dense source's through the same writer, and a model with two shared experts after a dense layer (ERNIE 4.5 MoE's
    graph)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope.update(high_freq_factor=4.0, original_max_position_embeddings=64)  # head_dim 8: every llama3 branch
    torch.manual_seed(0)
    fields = {**dense_config_fields(tiny_llama_config()), "rope_parameters": rope}
    config = LlamaMoEConfig(**fields, num_experts=4, moe_intermediate_size=24, score_scale_factor=[2.0, 0.5])
    model = LlamaMoEForCausalLM(config).eval()
    dense = tiny_llama(rope_parameters=rope)  # the dense source, through the same writer
    shared = tiny_moe(num_shared_experts=2, moe_layers=[1], score_scale_factor=2.0, num_experts_per_tok=3)
    models = {"moe": model, "dense": dense, "shared": shared}
    with torch.no_grad():  # larger weights (norms aside): routing and logits far from uniform
        for name, parameter in [p for m in models.values() for p in m.named_parameters()]:
            parameter.mul_(1 if "norm" in name else 10)
    exported = {}
    for name, source in models.items():
        source.save_pretrained(tmp_path / name)
        exported[name] = export_model(tmp_path / name, "gguf", tmp_path / f"{name}-gguf", progress=False).output_dir
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    f32 = llama_cpp.GGML_TYPE_F32  # the default F16 KV cache would round keys and values
    for name, source in models.items():
        llm = llama_cpp.Llama(str(exported[name] / "model.gguf"), n_ctx=64, logits_all=True, verbose=False,
                              type_k=f32, type_v=f32)  # fmt: skip
        llm.eval(ids)
        scores = torch.tensor(np.array(llm.scores[: len(ids)]))
        difference = (scores - logits(source, torch.tensor([ids]))[0]).abs().max()
        assert difference < 1e-4, (name, difference)


def test_refusals(converted, tiny_dense, tiny_calibration, tmp_path, capsys):
    dense, out = tiny_dense[0], tmp_path / "out"
    calibration = dict(calibration_data=str(tiny_calibration), **CALIBRATION, progress=False)
    gmoefication = convert_to_moe(dense, tmp_path / "g", num_experts=4, compensation=True, router_init="selector",
                                  selector_steps=5, **calibration).output_dir  # fmt: skip
    compensated = convert_to_moe(dense, tmp_path / "c", num_experts=4, compensation=True, **calibration).output_dir
    attn = convert_to_moe(
        dense, tmp_path / "a", family="attn_moe", attn_experts=2, attn_top_k=1, progress=False
    ).output_dir
    soap = convert_to_moe(dense, tmp_path / "s", family="soap_moe", num_experts=2, progress=False).output_dir
    cases = [
        (gmoefication, "qwen2_moe", "router_type 'selector'"),
        (compensated, "qwen2_moe", "moe_compensation"),
        (attn, "mixtral", "AttnMoE"),
        (soap, "qwen2_moe", "SoapMoE"),
        (converted["residual"], "mixtral", "shared experts (1)"),
        (converted["switch-dense-shared"], "gguf", "router_type 'switch'"),
        (dense, "mixtral", "not a converted LlamaMoE checkpoint"),
        (tmp_path / "missing", "mixtral", "is not a converted model folder"),
    ]
    for folder, target, message in cases:
        assert message in export_refusal([str(folder), "--to", target, "--output", str(out)], capsys), (folder, target)
    assert "--tokenizer-pre is an option of export target 'gguf'" in export_refusal(
        [str(converted["random"]), "--to", "mixtral", "--output", str(out), "--tokenizer-pre", "smollm"], capsys
    )


def test_a_router_with_no_known_exact_mapping_is_refused_not_exported_as_top_k(converted):
    """A gate added to the registry later is refused until a target states how it maps, rather than being written
    as the softmax top-k the targets compute."""
    from transformers import AutoConfig

    from llama_moe.export import TARGETS

    config = AutoConfig.from_pretrained(converted["random"])
    assert [name for name in TARGETS if TARGETS[name].supports(config)] == ["qwen3_moe"]  # a LLaMA source
    object.__setattr__(config, "router_type", "future_gate")
    for name in TARGETS:
        assert "router_type 'future_gate'" in TARGETS[name].supports(config)[0]
        with pytest.raises(ValueError, match="Cannot export this model to .* exactly: router_type 'future_gate'"):
            TARGETS[name](config).check()


def test_half_precision_export_notes_the_routers_precision(converted, tmp_path):
    from safetensors import safe_open

    result = export_model(converted["random"], "qwen2_moe", tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert any("router logits" in note and "bfloat16" in note for note in result.notes)
    with safe_open(result.output_dir / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}


def test_output_folder_rules_match_convert(converted, tmp_path, capsys):
    out = tmp_path / "deep" / "out"
    argv = ["export", str(converted["random"]), "--to", "mixtral", "--output", str(out), "--no-progress"]
    assert main(argv) == 0 and "wrote" in capsys.readouterr().out
    (out / "marker").write_text("old")
    assert main(argv) == 2 and "pass --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0 and not (out / "marker").exists()
    assert main(["export", str(converted["random"]), "--to", "mixtral", "--output", str(converted["random"])]) == 2
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no temporary folder left behind


def test_export_help_imports_neither_torch_nor_transformers():
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "llama_moe", "export", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "--tokenizer-pre" in run.stdout, run.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "llama_moe.export.registry" in imported
    assert not {name for name in imported if name.split(".")[0] in ("torch", "transformers", "gguf")}


def test_an_exported_folder_is_checked_against_its_source_in_its_dtype(converted, tmp_path, caplog):
    """The exported Mixtral equals its source, so the check finds it as good as its source, in bfloat16 too; a
    GGUF file is said not to be checked here; `--no-eval` skips the check."""
    with caplog.at_level("INFO", logger="llama_moe"):
        result = export_model(converted["random"], "mixtral", tmp_path / "m", dtype="bfloat16", progress=False)
    check = result.quality
    assert check.dtype == "bfloat16" and check.reference == "its source folder"
    assert check.kl < 0.02 and "as good as its source folder" in check.verdict()
    assert "Checking the result against its source folder" in caplog.text
    with caplog.at_level("INFO", logger="llama_moe"):
        assert export_model(converted["random"], "gguf", tmp_path / "g", progress=False).quality is None
    assert "Not checked here" in caplog.text
    assert export_model(converted["random"], "mixtral", tmp_path / "n", eval=False, progress=False).quality is None


def test_export_default_writes_the_built_in_dense_model(tmp_path, monkeypatch, tiny_dense):
    from llama_moe import loading

    monkeypatch.setattr(loading, "model_folder", lambda spec, **_: tiny_dense[0])  # the built-in one, in small
    result = export_model("default", "gguf", tmp_path / "gguf", progress=False)
    assert (result.output_dir / "model.gguf").is_file()

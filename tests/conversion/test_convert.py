"""The streaming converter, end to end on real files: exact identities against the dense model, remote code,
GGUF and Hub sources, and bad input that must fail cleanly without leaving anything behind."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import folder_hashes, load_moe, logits, quick_check_scores, save_tiny_dense, tiny_llama, tiny_llama_config
from huggingface_hub import ModelCard
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from llama_moe.checkpoints import load_gguf_model
from llama_moe.checkpoints.writer import read_shapes
from llama_moe.conversion.conversion_card import quality_section
from llama_moe.conversion.methods.base import SplitMethod
from llama_moe.conversion.quick_check import QuickCheck
from llama_moe.hub.card import PROJECT_URL, card_for_repo
from llama_moe_hf import METHODS, convert_to_moe
from llama_moe_hf.modeling.configuration_llama_moe import (
    LLAMA_MOE_VERSION,
    TRANSFORMERS_REQUIREMENT,
    TRANSFORMERS_TESTED,
)


@pytest.fixture(scope="module")
def tiny_dense_sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense") / "tiny-sharded"
    save_tiny_dense(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.mark.parametrize("method", ["random", "sequential"])
@pytest.mark.parametrize("num_shared", [0, 2])
@pytest.mark.parametrize("sharded_source", [False, True])
def test_split_all_experts_reproduces_dense(
    tmp_path, tiny_dense, tiny_dense_sharded, method, num_shared, sharded_source
):
    dense_path, input_ids, dense_logits = tiny_dense
    source = tiny_dense_sharded if sharded_source else dense_path
    result = convert_to_moe(
        source,
        tmp_path / "moe",
        method=method,
        num_experts=4,
        top_k=4,
        num_shared_experts=num_shared,
        router_init="zero",
        score_scale_factor=4.0,
        max_shard_size="40KB",
        progress=False,
    )
    # 96 neurons into 4 routed + num_shared shared experts of equal size
    config = json.loads((result.output_dir / "config.json").read_text())
    assert config["moe_intermediate_size"] == 96 // (4 + num_shared)
    assert config["num_shared_experts"] == num_shared
    assert (result.output_dir / "model.safetensors.index.json").is_file()  # the output is sharded too
    torch.testing.assert_close(logits(load_moe(result.output_dir), input_ids), dense_logits, atol=1e-4, rtol=0)


def test_upcycle_reproduces_dense_for_random_router(tmp_path, tiny_dense):
    dense_path, input_ids, dense_logits = tiny_dense
    result = convert_to_moe(dense_path, tmp_path / "moe", method="upcycle", num_experts=4, seed=3, progress=False)
    model = load_moe(result.output_dir)
    assert model.config.num_experts_per_tok == 2 and model.config.score_scale_factor == 1.0
    assert model.config.moe_intermediate_size == 96
    assert model.model.layers[0].mlp.gate.weight.abs().sum() > 0  # a real (random) router, not a trivial one
    torch.testing.assert_close(logits(model, input_ids), dense_logits, atol=1e-4, rtol=0)


def test_default_split_settings_and_seeds(tmp_path, tiny_dense):
    dense_path, _, _ = tiny_dense
    a = convert_to_moe(dense_path, tmp_path / "a", num_experts=4, top_k=2, seed=5, progress=False)
    b = convert_to_moe(dense_path, tmp_path / "b", num_experts=4, top_k=2, seed=5, progress=False)
    c = convert_to_moe(dense_path, tmp_path / "c", num_experts=4, top_k=2, seed=6, progress=False)
    config = json.loads((a.output_dir / "config.json").read_text())
    assert config["score_scale_factor"] == 2.0  # N/k
    recipe = config["conversion_info"]["recipe"]
    assert recipe["method"] == "random" and recipe["seed"] == 5 and recipe["score_scale_factor"] == 2.0
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_llama_moe.LlamaMoEForCausalLM"
    assert (
        config["auto_map"]["AutoModelForSequenceClassification"]
        == "modeling_llama_moe.LlamaMoEForSequenceClassification"
    )
    assert config["architectures"] == ["LlamaMoEForCausalLM"]
    assert folder_hashes(a.output_dir)["model.safetensors"] == folder_hashes(b.output_dir)["model.safetensors"]
    with (
        safe_open(a.output_dir / "model.safetensors", "pt") as fa,
        safe_open(c.output_dir / "model.safetensors", "pt") as fc,
    ):
        name = "model.layers.0.mlp.experts.gate_up_proj"
        assert not torch.equal(fa.get_tensor(name), fc.get_tensor(name))  # another seed, another split
        w = fa.get_tensor("model.layers.1.mlp.gate.weight")
        assert w.shape == (4, 64) and 0.01 < w.std() < 0.03  # normal(0, initializer_range=0.02)
    # total / active parameters, counted by hand: each MoE layer has 4 experts of 3 * 24 * 64, a token uses 2
    dense_total = sum(p.numel() for p in LlamaForCausalLM(tiny_llama_config()).parameters())
    router = 2 * 4 * 64
    assert a.total_parameters == dense_total + router
    assert a.active_parameters == a.total_parameters - 2 * (4 - 2) * 3 * 24 * 64


def test_bfloat16_output_and_partial_moe_layers(tmp_path, tiny_dense):
    dense_path, _, _ = tiny_dense
    result = convert_to_moe(
        dense_path, tmp_path / "moe", num_experts=2, top_k=1, moe_layers=[1], dtype="bfloat16", progress=False
    )
    with safe_open(result.output_dir / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert {f.get_tensor(name).dtype for name in names} == {torch.bfloat16}
        assert "model.layers.0.mlp.gate_proj.weight" in names  # layer 0 stays dense
        assert "model.layers.1.mlp.experts.gate_up_proj" in names
    model = AutoModelForCausalLM.from_pretrained(result.output_dir)
    assert model.config.moe_layers == [1] and model.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def smollm2_inputs(smollm2, real_text):
    model, tokenizer = smollm2
    input_ids = tokenizer(real_text[0], return_tensors="pt").input_ids[:, :48]
    return input_ids, logits(model, input_ids)


@pytest.mark.slow
def test_smollm2_split_with_shared_experts_reproduces_dense(tmp_path, smollm2_path, smollm2_inputs):
    input_ids, dense_logits = smollm2_inputs
    before = folder_hashes(smollm2_path)
    result = convert_to_moe(
        smollm2_path,
        tmp_path / "moe",
        method="random",
        num_experts=6,
        top_k=6,
        num_shared_experts=2,
        router_init="zero",
        score_scale_factor=6.0,
        progress=False,
    )
    assert folder_hashes(smollm2_path) == before
    names = set(read_shapes(result.output_dir))
    assert "lm_head.weight" not in names  # tied embeddings are written once, like transformers
    for file in ("tokenizer.json", "chat_template.jinja", "generation_config.json", "modeling_llama_moe.py"):
        assert (result.output_dir / file).is_file()
    torch.testing.assert_close(logits(load_moe(result.output_dir), input_ids), dense_logits, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_smollm2_sequential_and_upcycle_reproduce_dense(tmp_path, smollm2_path, smollm2_inputs):
    input_ids, dense_logits = smollm2_inputs
    sequential = convert_to_moe(
        smollm2_path,
        tmp_path / "seq",
        method="sequential",
        num_experts=4,
        top_k=4,
        router_init="zero",
        score_scale_factor=4.0,
        progress=False,
    )
    torch.testing.assert_close(logits(load_moe(sequential.output_dir), input_ids), dense_logits, atol=1e-4, rtol=0)
    # Upcycling: identity for any router; MoE in every fifth layer, dense MLPs in between.
    upcycled = convert_to_moe(
        smollm2_path, tmp_path / "up", method="upcycle", num_experts=4, moe_layers=list(range(0, 30, 5)), progress=False
    )
    model = load_moe(upcycled.output_dir)
    torch.testing.assert_close(logits(model, input_ids), dense_logits, atol=1e-4, rtol=0)
    # Routing is not trivial: the top-2 choices differ between tokens.
    out = model(input_ids, output_router_logits=True)
    chosen = out.router_logits[0].topk(2, dim=-1).indices
    assert len({tuple(row.tolist()) for row in chosen}) > 1


REMOTE_CODE_SCRIPT = textwrap.dedent(
    """
    import sys
    class Block:  # the package must not be importable: only the code saved next to the weights may run
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("llama_moe_hf", "llama_moe"):
                raise ImportError(f"{name} is blocked in this test")
    sys.meta_path.insert(0, Block())
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
    assert not {"llama_moe_hf", "llama_moe"} & set(sys.modules)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    classifier = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], trust_remote_code=True)
    assert type(classifier).__name__ == "LlamaMoEForSequenceClassification", type(classifier)
    input_ids = torch.load(sys.argv[2])
    with torch.no_grad():
        torch.save(model(input_ids).logits, sys.argv[3])
    """
)


@pytest.mark.smoke
def test_output_loads_as_remote_code_without_the_package(tmp_path, tiny_dense):
    dense_path, input_ids, _ = tiny_dense
    result = convert_to_moe(dense_path, tmp_path / "moe", num_experts=4, top_k=2, num_shared_experts=2, progress=False)
    torch.save(input_ids, tmp_path / "ids.pt")
    env = {**os.environ, "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", REMOTE_CODE_SCRIPT, str(result.output_dir), "ids.pt", "remote.pt"]
    run = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    remote = torch.load(tmp_path / "remote.pt")
    torch.testing.assert_close(remote, logits(load_moe(result.output_dir), input_ids), atol=1e-5, rtol=0)


def write_tiny_gguf(path: Path) -> None:
    """A tiny LLaMA GGUF (float32 tensors, byte-level BPE tokenizer with a chat template) written with `gguf`."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    hidden, inter, layers, heads, kv_heads = 64, 96, 2, 8, 2
    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    tokens = byte_tokens + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\u0120t"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 3, 1])
    writer.add_token_merges(["\u0120 t"])  # "Ġ t": one byte-level merge
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    def tensor(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    writer.add_tensor("token_embd.weight", tensor(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", 1 + tensor(hidden))
    writer.add_tensor("output.weight", tensor(len(tokens), hidden))
    kv = kv_heads * hidden // heads
    for i in range(layers):
        shapes = {
            "attn_norm": (hidden,),
            "ffn_norm": (hidden,),
            "attn_q": (hidden, hidden),
            "attn_k": (kv, hidden),
            "attn_v": (kv, hidden),
            "attn_output": (hidden, hidden),
            "ffn_gate": (inter, hidden),
            "ffn_up": (inter, hidden),
            "ffn_down": (hidden, inter),
        }
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", tensor(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_source(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    dense = load_gguf_model(gguf_path)
    input_ids = torch.randint(0, 260, (1, 9), generator=torch.Generator().manual_seed(0))
    result = convert_to_moe(
        gguf_path, tmp_path / "moe", num_experts=4, top_k=4, router_init="zero", score_scale_factor=4.0, progress=False
    )
    assert (result.output_dir / "tokenizer.json").is_file() and (result.output_dir / "chat_template.jinja").is_file()
    assert "GGUF" in json.loads((result.output_dir / "config.json").read_text())["conversion_info"]["source"]
    assert read_recipe_model(result.output_dir) == str(gguf_path.resolve())
    torch.testing.assert_close(
        logits(load_moe(result.output_dir), input_ids), logits(dense, input_ids), atol=1e-4, rtol=0
    )


def read_recipe_model(folder: Path):
    import yaml

    return yaml.safe_load((folder / "moe_recipe.yaml").read_text())["model"]


def test_hub_source_through_download_seam(tmp_path, tiny_dense):
    dense_path, input_ids, dense_logits = tiny_dense
    calls = []

    def fake_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(dense_path)

    result = convert_to_moe(
        "org/tiny-llama", tmp_path / "moe", method="upcycle", num_experts=2, download=fake_download, progress=False
    )
    ((repo_id, kwargs),) = calls
    assert repo_id == "org/tiny-llama" and "*.safetensors" in kwargs["allow_patterns"]
    assert not any(p.endswith(".bin") for p in kwargs["allow_patterns"])  # no pickles unless allowed
    card = ModelCard.load(result.output_dir / "README.md")
    assert card.data.base_model == "org/tiny-llama"
    assert read_recipe_model(result.output_dir) == "org/tiny-llama"  # the recipe names the Hub id, not the cache
    torch.testing.assert_close(logits(load_moe(result.output_dir), input_ids), dense_logits, atol=1e-4, rtol=0)

    def offline(repo_id, **kwargs):
        raise ConnectionError("no network")

    with pytest.raises(FileNotFoundError, match="could not be downloaded from the Hugging Face Hub.*no network"):
        convert_to_moe("org/other", tmp_path / "moe2", download=offline, progress=False)
    assert not (tmp_path / "moe2").exists()


def test_model_card(tmp_path, tiny_dense):
    dense_path, _, _ = tiny_dense
    result = convert_to_moe(
        dense_path,
        tmp_path / "moe",
        num_experts=4,
        top_k=1,
        num_shared_experts=2,
        base_model="org/base",
        license="apache-2.0",
        repo_id="me/tiny-moe",
        progress=False,
    )
    card = ModelCard.load(result.output_dir / "README.md")
    assert card.data.base_model == "org/base" and card.data.license == "apache-2.0"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"moe", "mixture-of-experts", "llama-moe"} <= set(card.data.tags)
    text = card.text
    assert f"| Total | {result.total_parameters:,} " in text
    assert f"| Active per token | {result.active_parameters:,} " in text
    assert "| Score scale factor | 4.0 |" in text  # N/k default
    assert "| Shared (always-on) experts | 2 |" in text
    assert 'from_pretrained("me/tiny-moe", trust_remote_code=True)' in text
    assert "import llama_moe_hf" in text
    assert "moe_recipe.yaml" in text and "method: random\n" in text  # the recipe it was built from
    # which code the folder carries and the transformers releases it runs on
    tested = " and ".join(TRANSFORMERS_TESTED)
    assert f"llama-moe-hf {LLAMA_MOE_VERSION}'s: it runs on transformers `{TRANSFORMERS_REQUIREMENT}`" in text
    assert f"(tested with {tested})" in text and "`llama-moe upgrade DIR`" in text


def test_model_card_of_a_folder_without_tokenizer_names_the_source_tokenizer(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "dense")  # weights and config only
    result = convert_to_moe(tmp_path / "dense", tmp_path / "moe", num_experts=4, base_model="org/base", progress=False)
    assert not {"tokenizer.json", "tokenizer_config.json"} & set(result.files)
    text = (result.output_dir / "README.md").read_text()
    assert "no tokenizer files" in text and 'AutoTokenizer.from_pretrained("org/base")' in text
    assert 'from_pretrained("moe")' not in text and "llama-moe chat" not in text  # both need a tokenizer here
    assert 'AutoModelForCausalLM.from_pretrained("moe", trust_remote_code=True)' in text
    pushed = card_for_repo(text, result.output_dir, "me/moe")  # the card `push` uploads says the same
    assert "no tokenizer files" in pushed and 'PreTrainedTokenizerFast.from_pretrained("me/moe")' not in pushed


def test_card_links_to_docs_are_absolute_urls_of_the_repository():
    text = quality_section(QuickCheck(quick_check_scores(match=0.0, kl=3.0, ratio=10.0)))
    assert f"[docs/training.md]({PROJECT_URL}/blob/HEAD/docs/training.md)" in text
    assert "(docs/" not in text  # no path relative to a repository the card is not in


def test_model_card_names_no_local_path_and_installs_from_the_repository(tmp_path, tiny_dense):
    dense_path, _, _ = tiny_dense
    data = tmp_path / "calibration.txt"
    data.write_text("Some calibration text for the card test. " * 40)
    output = tmp_path / "outputs" / "tiny-moe"
    convert_to_moe(
        dense_path,
        output,
        method="cluster",
        num_experts=4,
        calibration_data=str(data),
        calibration_tokens=256,
        calibration_seq_len=64,
        progress=False,
    )
    text = (output / "README.md").read_text()
    for local in (str(tmp_path), str(dense_path), str(data)):
        assert local not in text
    assert 'from_pretrained("tiny-moe", trust_remote_code=True)' in text  # the folder's name until it is pushed
    assert "calibration_data: calibration.txt" in text and f"| Source | `{dense_path.name}` |" in text
    assert "pip install 'llama-moe-hf @ git+https://github.com/llama-moe-hf/llama-moe-hf'" in text
    assert "pip install llama-moe-hf`" not in text  # not a published package
    assert 'PreTrainedTokenizerFast.from_pretrained("tiny-moe")' in text


# ---------------------------------------------------------------- bad input: one clear error, nothing written


@pytest.fixture
def workspace(tmp_path, tiny_dense):
    """A copy-free setup: outputs go into an empty folder that must stay empty after a failure."""
    out_root = tmp_path / "out"
    out_root.mkdir()
    dense_path = tiny_dense[0]
    before = folder_hashes(dense_path)
    yield dense_path, out_root
    assert list(out_root.iterdir()) == [], "a failed conversion left files behind"
    assert folder_hashes(dense_path) == before, "the source was modified"


def _save_config_only(path: Path, config) -> Path:
    path.mkdir()
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_experts": 4, "top_k": 5}, ValueError, "--top-k must be between 1 and --num-experts=4"),
        ({"num_experts": 5, "top_k": 2}, ValueError, "96 is not divisible by 5"),
        ({"num_experts": 4, "num_shared_experts": 1}, ValueError, "96 is not divisible by 5"),
        ({"method": "upcycle", "num_shared_experts": 1}, ValueError, "not supported with method 'upcycle'"),
        ({"method": "nope"}, ValueError, "Unknown construction method 'nope'"),
        ({"moe_layers": [0, 7]}, ValueError, r"names layers \[7\], but the model has layers 0..1"),
        ({"method": "upcycle", "compensation": True}, ValueError, "--compensation needs a method that splits"),
        ({"dtype": "int8"}, ValueError, "Unknown dtype 'int8'"),
    ],
)
def test_impossible_settings(workspace, kwargs, error, message):
    dense_path, out_root = workspace
    with pytest.raises(error, match=message):
        convert_to_moe(dense_path, out_root / "moe", progress=False, **kwargs)


def test_a_conversion_that_will_not_fit_stops_before_reading_a_weight(workspace, tiny_calibration, monkeypatch, caplog):
    """A stage over the free memory, or over the free disk where it writes, stops the run in one line naming it and
    the flags that lower it (nothing read or written, the source untouched); --force runs anyway, says the forecast
    (memory, time, disk), records memory and disk in the config and logs each stage's time beside the forecast's."""
    from llama_moe import footprint
    from llama_moe.checkpoints.folder import FolderSource
    from llama_moe.conversion import forecast

    dense_path, out_root = workspace
    healed = dict(method="residual", num_experts=3, num_shared_experts=1, top_k=2, heal_tokens=64, joint_heal_tokens=64)
    healed |= dict(calibration_data=str(tiny_calibration), calibration_tokens=128, calibration_seq_len=32)
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 0.5 * footprint.GIB)
    reads = []
    monkeypatch.setattr(FolderSource, "tensor", lambda self, name: reads.append(name))
    with pytest.raises(ValueError, match=r"^The layer heal stage needs about 1\.0 GiB and 0\.5 GiB is free: lower "):
        convert_to_moe(dense_path, out_root / "moe", progress=False, eval=False, **healed)
    assert reads == []
    with pytest.raises(ValueError, match=r"lower --calibration-tokens, --calibration-samples, --offload-dir; --heal-"):
        convert_to_moe(dense_path, out_root / "moe", progress=False, eval=False, **healed)
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 20 * footprint.GIB)
    monkeypatch.setattr(forecast, "disk_free", lambda folder: 1e5)
    with pytest.raises(
        ValueError, match=rf"^The layer heal stage writes about 0\.0 GiB in {out_root} and 0\.0 GiB is "
    ):
        convert_to_moe(dense_path, out_root / "moe", progress=False, eval=False, **healed)
    assert reads == [] and not any(out_root.iterdir())
    monkeypatch.undo()
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 0.5 * footprint.GIB)
    with caplog.at_level("DEBUG", logger="llama_moe.conversion"):
        result = convert_to_moe(dense_path, out_root / "moe", progress=False, eval=False, force=True, **healed)
    assert re.search(
        r"Forecast: calibration 1\.0 GiB ~\d+ s, layer heal 1\.0 GiB ~\d+ s, joint heal 1\.\d GiB", caplog.text
    )
    assert (
        f"(free 0.5 GiB); on disk: layer heal 0.0 GiB in {out_root}, joint heal 0.0 GiB in {out_root}." in caplog.text
    )
    times = r"Stage times \(s; forecast in brackets\): calibration [\d.]+ \([\d.]+\), layer heal [\d.]+ \([\d.]+\), "
    assert re.search(times + r"joint heal [\d.]+ \([\d.]+\); matmul [\d.]+ GFLOP/s\.", caplog.text)
    forecast = json.loads((result.output_dir / "config.json").read_text())["conversion_info"]["forecast"]
    assert set(forecast["memory_gib"]) == {"calibration", "layer heal", "joint heal"}  # no times: a rerun's is the same
    assert set(forecast["disk_gib"]) == {"layer heal", "joint heal"}
    shutil.rmtree(result.output_dir)  # the workspace must end empty


@pytest.mark.parametrize("method", ["residual", "sharing-inner", "sharing-inter", "cluster"])
def test_the_forecast_counts_the_gradient_passes_the_calibration_runs(workspace, tiny_calibration, monkeypatch, method):
    """A method's `gradient_pass` (what the time forecast counts) is whether its calibration back-propagates."""
    from llama_moe.conversion.calibration import CalibrationContext
    from llama_moe.conversion.registry import METHODS

    dense_path, out_root = workspace
    passes, importance = [], CalibrationContext.importance
    monkeypatch.setattr(
        CalibrationContext,
        "importance",
        lambda self, key, *a, **k: passes.append(key) or importance(self, key, *a, **k),
    )
    shared = dict(num_shared_experts=1) if method == "residual" else {}
    result = convert_to_moe(
        dense_path,
        out_root / "moe",
        progress=False,
        eval=False,
        method=method,
        num_experts=2,
        top_k=1,
        calibration_data=str(tiny_calibration),
        calibration_tokens=64,
        calibration_seq_len=32,
        **shared,
    )
    assert bool(set(passes)) == METHODS[method].gradient_pass
    shutil.rmtree(result.output_dir)


@pytest.mark.parametrize(
    ("method", "stages"), [("random", {"write"}), ("cluster", {"write"}), ("residual", {"calibration", "write"})]
)
def test_the_forecast_has_a_calibration_stage_only_where_the_conversion_calibrates(workspace, method, stages):
    """k-means on the weights (`cluster`'s default) and random splits read no calibration text; `residual` does."""
    dense_path, out_root = workspace
    shared = dict(num_shared_experts=1) if method == "residual" else {}
    fields = dict(method=method, num_experts=2, top_k=1, calibration_tokens=256, calibration_seq_len=32, **shared)
    result = convert_to_moe(dense_path, out_root / "moe", progress=False, eval=False, **fields)
    info = json.loads((result.output_dir / "config.json").read_text())["conversion_info"]
    assert set(info["forecast"]["memory_gib"]) == stages
    assert ("calibration_data" in info) == ("calibration" in stages)
    shutil.rmtree(result.output_dir)


def test_missing_source(workspace):
    _, out_root = workspace
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_to_moe(out_root.parent / "no-such-folder", out_root / "moe", progress=False)
    with pytest.raises(FileNotFoundError, match="GGUF file .* does not exist"):
        convert_to_moe(out_root.parent / "missing.gguf", out_root / "moe", progress=False)


def test_refuses_mlp_bias_and_converted_models(workspace, tmp_path):
    """(Architectures outside the source families: tests/conversion/test_source_families.py.)"""
    _, out_root = workspace
    biased = _save_config_only(tmp_path / "biased", tiny_llama_config(mlp_bias=True))
    with pytest.raises(ValueError, match="mlp_bias=True"):
        convert_to_moe(biased, out_root / "moe", progress=False)
    already_moe = tmp_path / "moe-source"
    convert_to_moe(workspace[0], already_moe, num_experts=2, progress=False)
    with pytest.raises(ValueError, match="is a 'llama_moe' model"):
        convert_to_moe(already_moe, out_root / "moe", progress=False)


def test_pickled_checkpoint_needs_opt_in(workspace, tmp_path, tiny_dense):
    _, out_root = workspace
    _, input_ids, dense_logits = tiny_dense
    pickled = tmp_path / "pickled"
    model = save_tiny_dense(pickled)  # same seed as tiny_dense: same weights
    (pickled / "model.safetensors").unlink()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pickled weights .*--allow-pickle"):
        convert_to_moe(pickled, out_root / "moe", progress=False)
    result = convert_to_moe(
        pickled, tmp_path / "ok", method="upcycle", num_experts=2, allow_pickle=True, progress=False
    )
    torch.testing.assert_close(logits(load_moe(result.output_dir), input_ids), dense_logits, atol=1e-4, rtol=0)


def test_corrupt_and_incomplete_checkpoints(workspace, tmp_path, tiny_dense_sharded):
    _, out_root = workspace
    truncated = tmp_path / "truncated"
    save_tiny_dense(truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors: it is corrupt or truncated"):
        convert_to_moe(truncated, out_root / "moe", progress=False)

    garbage = tmp_path / "garbage"
    save_tiny_dense(garbage)
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        convert_to_moe(garbage, out_root / "moe", progress=False)

    missing_shard = tmp_path / "missing-shard"
    shutil.copytree(tiny_dense_sharded, missing_shard)
    (missing_shard / "model-00002-of-00014.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="lists shards that are missing"):
        convert_to_moe(missing_shard, out_root / "moe", progress=False)

    incomplete = tmp_path / "incomplete"
    save_tiny_dense(incomplete)
    state = load_file(incomplete / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, incomplete / "model.safetensors")
    with pytest.raises(ValueError, match=r"not a complete LlamaForCausalLM checkpoint: 1 tensors are missing"):
        convert_to_moe(incomplete, out_root / "moe", progress=False)

    no_weights = _save_config_only(tmp_path / "no-weights", tiny_llama_config())
    with pytest.raises(FileNotFoundError, match="has no model weights"):
        convert_to_moe(no_weights, out_root / "moe", progress=False)


def test_existing_output_needs_overwrite(workspace, tmp_path):
    dense_path, _out_root = workspace
    target = tmp_path / "existing"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError, match="already exists; pass --overwrite"):
        convert_to_moe(dense_path, target, progress=False)
    assert (target / "keep.txt").read_text() == "old"
    with pytest.raises(ValueError, match="would replace the source"):
        convert_to_moe(dense_path, dense_path, overwrite=True, progress=False)
    result = convert_to_moe(dense_path, target, num_experts=2, overwrite=True, progress=False)
    assert not (target / "keep.txt").exists() and (result.output_dir / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp/old folders


@pytest.fixture(params=[RuntimeError, KeyboardInterrupt])
def failing_method(request):
    """A method that breaks half-way, like a crash or Ctrl-C in the middle of a long conversion."""
    error = request.param

    @METHODS.register("failing")
    class Failing(SplitMethod):
        description = "fails in layer 1"

        def split(self, layer_idx, dense, context):
            if layer_idx == 1:
                raise error("boom in layer 1")
            return METHODS["sequential"].split(self, layer_idx, dense, context)

    yield error
    METHODS.unregister("failing")


def test_interrupted_conversion_leaves_nothing(workspace, failing_method):
    dense_path, out_root = workspace
    with pytest.raises(failing_method, match="boom in layer 1"):
        convert_to_moe(dense_path, out_root / "nested" / "moe", method="failing", num_experts=4, progress=False)


@pytest.mark.slow
def test_readme_python_api_snippet_runs_as_written(tmp_path, monkeypatch, smollm2_path):
    """The README's "same from Python" block, in a fresh folder (what its `overwrite=True` does to a folder that is
    there: test_existing_output_needs_overwrite, on a tiny model)."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = [block.split("```", 1)[0] for block in readme.split("```python\n")[1:]]
    (snippet,) = [block for block in blocks if "convert_to_moe(" in block]
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["result"].output_dir.is_dir() and namespace["moe"].config.num_experts == 8


def test_conversion_reports_perplexity_next_to_the_dense_model(tmp_path, tiny_dense):
    dense_path, _, _ = tiny_dense
    result = convert_to_moe(dense_path, tmp_path / "up", method="upcycle", num_experts=2, progress=False)
    check = result.quality
    assert check.ratio == pytest.approx(1.0, abs=1e-4) and check.kl < 1e-4 and check.close  # upcycled == dense
    assert check.match is None  # the tiny tokenizer has no chat template: text only
    assert "as good as the dense model" in check.verdict()
    assert "Measured after conversion" in (tmp_path / "up" / "README.md").read_text()
    skipped = convert_to_moe(dense_path, tmp_path / "no", method="upcycle", num_experts=2, eval=False, progress=False)
    assert skipped.quality is None and "Measured after" not in (tmp_path / "no" / "README.md").read_text()

"""`llama-moe merge --add-expert MODEL --into MOE`: one more expert model in a merged MoE. Tokens whose top-k leaves
out the new expert get exactly the MLP output they got before (softmax top-k renormalised over the selected experts);
every other tensor and file is the merged model's; bad input is one line, exit status 2, nothing written."""

import json
import shutil

import pytest
import torch
import yaml
from helpers import ffn_variant, folder_hashes, one_error_line, save_with_tokenizer, tiny_source
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from llama_moe.commands import main
from llama_moe.conversion.registry import ROUTER_INITS
from llama_moe.conversion.settings import RunOptions
from llama_moe.merging.config import ExpertSource, MergeConfig
from llama_moe.merging.pipeline import merge

OLD = 3  # expert models of the merge
# The merges grown: a random gate, with a shared expert, and (when registered) a prompt gate over averaged non-FFN weights
MERGES = [
    {"gate_mode": "random"},
    {"gate_mode": "random", "shared": True},
    *([{"gate_mode": "cheap_embed", "non_ffn": "average"}] if "cheap_embed" in ROUTER_INITS else []),
]
PROMPT_GATES = [name for name, init in ROUTER_INITS.items() if init.needs_expert_inputs]
NO_RUN = ["--no-progress", "--no-eval"]
REWRITTEN = {"config.json", "README.md", "merge_recipe.yaml", "model.safetensors"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base folder, [the merge's expert folders], the added model's folder)."""
    root = tmp_path_factory.mktemp("add-expert")
    base = tiny_source("llama", seed=0)
    folders = [save_with_tokenizer(ffn_variant(base, 10 + i), root / f"expert{i}") for i in range(OLD + 1)]
    return save_with_tokenizer(base, root / "base"), folders[:OLD], folders[OLD]


@pytest.fixture(scope="module", params=MERGES, ids=lambda fields: "-".join(map(str, fields.values())))
def added(request, models, tmp_path_factory):
    """(the merged folder, the folder with one expert added, the gate mode), the expert added on the command line."""
    base, experts, new = models
    fields = dict(request.param)
    root = tmp_path_factory.mktemp("merge")
    config = MergeConfig(
        experts=tuple(ExpertSource(str(e), (f"text of expert {i}",)) for i, e in enumerate(experts)),
        base_model=str(base),
        shared_experts=(ExpertSource(str(base), residual_scale=0.5),) if fields.pop("shared", False) else (),
        experts_per_token=2,
        **fields,
    )
    merged = merge(config, RunOptions(output=str(root / "merged"), progress=False, eval=False)).output_dir
    argv = ["merge", "--add-expert", str(new), "--into", str(merged), "--positive-prompts", "law", "statutes"]
    assert main([*argv, "--output", str(root / "grown"), *NO_RUN]) == 0
    return merged, root / "grown", config.gate_mode


def test_tokens_not_routed_to_the_new_expert_keep_their_output(added):
    merged, grown, _ = added
    old, new = (AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in (merged, grown))
    hidden = torch.randn(1, 256, old.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for old_layer, new_layer in zip(old.model.layers, new.model.layers, strict=True):
        with torch.no_grad():
            routed = (new_layer.mlp.gate(hidden)[2] == OLD).any(-1)  # [T]: the new expert among the top-k
            before, after = old_layer.mlp(hidden)[0], new_layer.mlp(hidden)[0]
        assert 0 < routed.sum() < routed.numel()
        torch.testing.assert_close(after[~routed], before[~routed], atol=1e-6, rtol=1e-5)
        assert ((after[routed] - before[routed]).abs().amax(-1) > 1e-4).all()


def test_only_the_new_expert_and_its_router_rows_are_new(added, models):
    merged, grown, _ = added
    before, after = load_file(merged / "model.safetensors"), load_file(grown / "model.safetensors")
    ffn = load_file(models[2] / "model.safetensors")
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj", "gate.weight")):
            assert after[name].shape[0] == OLD + 1 and torch.equal(after[name][:OLD], tensor), name
        else:
            assert torch.equal(after[name], tensor), name
    for mlp in (name.removesuffix("experts.down_proj") for name in before if name.endswith("experts.down_proj")):
        gate_up = torch.cat([ffn[mlp + "gate_proj.weight"], ffn[mlp + "up_proj.weight"]])
        assert torch.equal(after[mlp + "experts.gate_up_proj"][OLD], gate_up)
        assert torch.equal(after[mlp + "experts.down_proj"][OLD], ffn[mlp + "down_proj.weight"])
    kept = {name: digest for name, digest in folder_hashes(merged).items() if name not in REWRITTEN}
    assert "tokenizer.json" in kept and any(name.endswith(".py") for name in kept)
    assert {name: folder_hashes(grown)[name] for name in kept} == kept


def test_the_config_recipe_and_card_count_the_new_expert(added, models):
    merged, grown, gate = added
    before, after = (json.loads((f / "config.json").read_text()) for f in (merged, grown))
    assert after["num_experts"] == before["num_experts"] + 1 == OLD + 1
    assert {k: v for k, v in after.items() if k not in ("num_experts", "conversion_info")} == {
        k: v for k, v in before.items() if k not in ("num_experts", "conversion_info")
    }
    entries = after["conversion_info"]["merge"]["experts"]
    assert entries[:OLD] == before["conversion_info"]["merge"]["experts"]
    assert entries[OLD]["source_model"] == str(models[2].resolve()) and entries[OLD]["positive_prompts"] == [
        "law",
        "statutes",
    ]
    assert after["conversion_info"]["merge"]["gate_mode"] == gate
    recipe = yaml.safe_load((grown / "merge_recipe.yaml").read_text())
    assert [e["source_model"] for e in recipe["experts"]][OLD:] == [str(models[2])]
    assert recipe["experts"][OLD]["positive_prompts"] == ["law", "statutes"]
    card = (grown / "README.md").read_text()
    assert f"| {OLD} | `{models[2].name}`" in card and "'statutes'" in card


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("not merged", "is not a merged model"),
        ("family", "a merge takes models of one source family"),
        ("shape", "a merge takes models of one shape"),
        ("router", "only under softmax top-k"),
        ("split", "only to merges that keep whole FFNs"),
        ("prompts", "give --positive-prompts"),
        ("flags", "drop --experts"),
        ("no --into", "needs both --add-expert MODEL and --into"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(change, message, added, models, tmp_path, capsys):
    merged, _, _ = added
    into, model = tmp_path / "into", tmp_path / "model"
    shutil.copytree(merged, into)
    shutil.copytree(models[2], model)
    extra = ["--positive-prompts", "law"]
    if change == "not merged":
        (into / "merge_recipe.yaml").unlink()
    if change == "family":
        save_with_tokenizer(tiny_source("qwen2", seed=0), model)
    if change == "shape":
        save_with_tokenizer(tiny_source("llama", seed=0, head_dim=4), model)
    if change == "router":
        config = json.loads((into / "config.json").read_text())
        (into / "config.json").write_text(json.dumps(config | {"router_type": "switch"}))
    if change == "split":
        recipe = (into / "merge_recipe.yaml").read_text().replace("experts_per_model: 1", "experts_per_model: 2")
        (into / "merge_recipe.yaml").write_text(recipe.replace("method: upcycle", "method: random"))
    if change == "prompts":
        if not PROMPT_GATES:
            pytest.skip("no gate mode that reads prompts is registered")
        (into / "merge_recipe.yaml").write_text(
            (into / "merge_recipe.yaml").read_text().replace(f"gate_mode: {added[2]}", f"gate_mode: {PROMPT_GATES[0]}")
        )
        extra = []
    if change == "flags":
        extra += ["--experts", str(model)]
    argv = ["merge", "--add-expert", str(model), "--output", str(tmp_path / "out"), *extra, *NO_RUN]
    if change != "no --into":
        argv += ["--into", str(into)]
    capsys.readouterr()
    assert main(argv) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))

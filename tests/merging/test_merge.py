"""`llama-moe merge`: several dense models of one family -> one MoE. With every token routed to expert i the merged
model is source model i (sources that share all but the FFN), for every source family; the exports to Mixtral,
Qwen2-MoE and Qwen3-MoE equal the merged model in transformers' own classes; mergekit-moe's YAML is read as it is;
bad input is one line, exit status 2, nothing written."""

import copy
import json

import pytest
import torch
from helpers import (
    ffn_variant,
    load_moe,
    logits,
    one_error_line,
    save_with_tokenizer,
    tiny_source,
    token_batch,
)

from llama_moe.commands import main
from llama_moe.conversion.settings import RunOptions
from llama_moe.merging.config import ExpertSource, MergeConfig
from llama_moe.merging.pipeline import merge

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
RUN = dict(progress=False, eval=False)


def sources(root, family: str, count: int = 3, **overrides):
    """(base folder, [expert folders], [expert models]) of `family`."""
    base = tiny_source(family, seed=0, **overrides)
    experts = [ffn_variant(base, 10 + i) for i in range(count)]
    folders = [save_with_tokenizer(model, root / f"{family}-expert{i}") for i, model in enumerate(experts)]
    return save_with_tokenizer(base, root / f"{family}-base"), folders, experts


def merged(root, base, experts, name="merged", **fields):
    config = MergeConfig(
        experts=tuple(ExpertSource(str(e)) for e in experts),
        base_model=str(base),
        **{"gate_mode": "random", "experts_per_token": 1, **fields},
    )
    return merge(config, RunOptions(output=str(root / name), **RUN)).output_dir


def route_every_token_to(model, *experts: int) -> None:
    """Each MoE layer's router sends every token to `experts`, with equal weights summing to 1."""
    for layer in model.model.layers:
        gate = layer.mlp.gate

        def forward(hidden_states, gate=gate):
            states = hidden_states.reshape(-1, gate.hidden_dim)
            weights = torch.full((states.shape[0], len(experts)), 1 / len(experts))
            return gate.logits(states), weights, torch.tensor(experts).expand(states.shape[0], -1)

        gate.forward = forward


@pytest.mark.parametrize("family", FAMILIES)
def test_every_token_routed_to_expert_i_is_source_model_i(family, tmp_path):
    base, folders, experts = sources(tmp_path, family)
    model = load_moe(merged(tmp_path, base, folders))
    ids = token_batch(length=16)
    for i, expert in enumerate(experts):
        route_every_token_to(model, i)
        torch.testing.assert_close(logits(model, ids), logits(expert, ids), atol=1e-4, rtol=1e-4)


def test_each_model_split_into_experts_is_that_model_with_all_its_pieces_on(tmp_path):
    base, folders, experts = sources(tmp_path, "qwen2", count=2)
    model = load_moe(merged(tmp_path, base, folders, method="sequential", experts_per_model=2, experts_per_token=2))
    assert model.config.num_experts == 4 and model.config.score_scale_factor == 2.0
    ids = token_batch(length=16)
    for i, expert in enumerate(experts):
        route_every_token_to(model, 2 * i, 2 * i + 1)
        torch.testing.assert_close(logits(model, ids), logits(expert, ids), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not 'fine_grained_upcycle'"):
        merged(tmp_path, base, folders, name="fine", method="fine_grained_upcycle")


def test_the_merged_folder_records_its_sources(tmp_path):
    base, folders, _ = sources(tmp_path, "llama", count=2)
    out = merged(tmp_path, base, folders, experts_per_token=2)
    info = json.loads((out / "config.json").read_text())["conversion_info"]["merge"]
    assert [e["source_model"] for e in info["experts"]] == [str(f.resolve()) for f in folders]
    assert info["gate_mode"] == "random"
    card = (out / "README.md").read_text()
    assert "llama-expert0" in card and "merge_recipe.yaml" in card and str(tmp_path) not in card
    assert (out / "merge_recipe.yaml").read_text().count("source_model") == 2


def test_a_merge_that_will_not_fit_stops_before_its_work(tmp_path, monkeypatch, caplog):
    """The merge's forecast, as convert's: one line naming the stage, what it needs and what is free, before the
    non-FFN weights are compared, the gate's passes and the write (nothing read or written); with room, the forecast
    is in the folder's conversion_info."""
    from llama_moe import footprint

    caplog.set_level("INFO", logger="llama_moe")
    shared = "The expert models share every non-FFN weight with the base."
    base, folders, _ = sources(tmp_path, "llama", count=2)
    before = set(tmp_path.iterdir())
    with monkeypatch.context() as tight:
        tight.setattr(footprint, "available_bytes", lambda device: 0.1 * footprint.GIB)
        with pytest.raises(
            ValueError,
            match=r"^The write stage needs about \d\.\d GiB and 0\.1 GiB is free: run it where more memory is free, or ",
        ):
            merged(tmp_path, base, folders)
    assert set(tmp_path.iterdir()) == before and shared not in caplog.messages
    forecast = json.loads((merged(tmp_path, base, folders) / "config.json").read_text())["conversion_info"]["forecast"]
    assert set(forecast["memory_gib"]) == set(forecast["disk_gib"]) == {"write"}
    assert shared in caplog.messages


@pytest.mark.parametrize(
    ("family", "architecture", "shared"),
    [("mistral", "mixtral", False), ("qwen2", "qwen2_moe", True), ("qwen3", "qwen3_moe", False)],
)
def test_the_export_equals_the_merged_model_in_transformers(family, architecture, shared, tmp_path):
    from transformers import AutoModelForCausalLM

    base, folders, _ = (
        sources(tmp_path, family, use_sliding_window=False) if family == "qwen3" else sources(tmp_path, family)
    )
    fields = dict(experts_per_token=2)
    if shared:
        fields["shared_experts"] = (ExpertSource(str(base), residual_scale=0.5),)
    ours = load_moe(merged(tmp_path, base, folders, **fields))
    out = merged(tmp_path, base, folders, name="exported", architecture=architecture, **fields)
    stock = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(stock).__module__.startswith(f"transformers.models.{architecture}")
    ids = token_batch(length=16)
    torch.testing.assert_close(logits(stock, ids), logits(ours, ids), atol=1e-4, rtol=1e-4)
    assert (out / "merge_recipe.yaml").is_file()


def test_a_merge_exported_to_a_stock_family_is_checked_as_written(tmp_path, caplog):
    base, folders, _ = sources(tmp_path, "mistral")
    config = MergeConfig(
        experts=tuple(ExpertSource(str(e)) for e in folders),
        base_model=str(base),
        gate_mode="random",
        experts_per_token=1,
        architecture="mixtral",
    )
    with caplog.at_level("INFO", logger="llama_moe"):
        result = merge(config, RunOptions(output=str(tmp_path / "out"), **{**RUN, "eval": True}))
    assert result.quality is not None and "Checking the result against the dense model" in caplog.text


def test_non_ffn_average_and_the_difference_report(tmp_path, caplog):
    base, folders, experts = sources(tmp_path, "llama", count=2)
    moved = copy.deepcopy(experts[0])
    with torch.no_grad():
        moved.model.layers[0].self_attn.q_proj.weight.mul_(2.0)
    save_with_tokenizer(moved, folders[0])
    with caplog.at_level("WARNING", logger="llama_moe.merging.sources"):
        out = merged(tmp_path, base, folders, non_ffn="average")
    assert "self_attn.q_proj.weight" in caplog.text and "largest relative difference 1" in caplog.text
    model = load_moe(out)
    expected = (2.0 + 1.0 + 1.0) / 3 * experts[1].model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(model.model.layers[0].self_attn.q_proj.weight, expected)


MERGEKIT = """
base_model: {base}
gate_mode: random
dtype: bfloat16
experts_per_token: 2
experts:
  - source_model: {e0}
    positive_prompts: ["code"]
  - source_model: {e1}
    positive_prompts: ["math"]
    noise_scale: 0.01
"""


def test_a_mergekit_file_is_read_as_it_is(tmp_path, capsys):
    base, folders, _ = sources(tmp_path, "llama", count=2)
    path = tmp_path / "mergekit.yaml"
    path.write_text(MERGEKIT.format(base=base, e0=folders[0], e1=folders[1]))
    assert main(["merge", "--config", str(path), "--output", str(tmp_path / "mk"), "--no-progress", "--no-eval"]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((tmp_path / "mk" / "config.json").read_text())
    assert config["num_experts"] == 2 and config["num_experts_per_tok"] == 2 and config["dtype"] == "bfloat16"
    recipe = (tmp_path / "mk" / "merge_recipe.yaml").read_text()
    assert "noise_scale: 0.01" in recipe and "- code" in recipe


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("family", "a merge takes models of one source family"),
        ("shape", "a merge takes models of one shape"),
        ("gate", "Unknown router initialisation 'prompt_magic'"),
        ("mergekit", "tokenizer_source: the base model's tokenizer is used"),
        ("lora", "LoRA references"),
        ("architecture", "Cannot merge into mixtral exactly: attention biases"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(change, message, tmp_path, capsys):
    base, folders, _ = sources(tmp_path, "llama", count=2)
    fields = {"gate_mode": "random"}
    if change == "family":
        save_with_tokenizer(tiny_source("qwen2", seed=0), folders[1])
    if change == "shape":
        save_with_tokenizer(tiny_source("llama", seed=0, head_dim=4), folders[1])
    if change == "gate":
        fields["gate_mode"] = "prompt_magic"
    if change == "mergekit":
        fields["tokenizer_source"] = "union"
    if change == "architecture":
        fields["architecture"] = "mixtral"
    if change == "lora":
        folders[1] = f"{folders[1]}+org/adapter"
    text = f"base_model: {base}\nexperts:\n" + "".join(f"  - source_model: {f}\n" for f in folders)
    text += "".join(f"{key}: {value}\n" for key, value in fields.items())
    (tmp_path / "m.yaml").write_text(text)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["merge", "--config", str(tmp_path / "m.yaml"), "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_flags_without_a_file(tmp_path, capsys):
    base, folders, _ = sources(tmp_path, "llama", count=2)
    argv = ["merge", "--base-model", str(base), "--experts", *map(str, folders), "--gate-mode", "random"]
    out = tmp_path / "flags"
    assert main([*argv, "--output", str(out), "--no-progress", "--no-eval"]) == 0
    assert json.loads((out / "config.json").read_text())["num_experts"] == 2
    capsys.readouterr()
    assert main(["merge", "--output", str(tmp_path / "none")]) == 2
    assert "--experts" in one_error_line(capsys)


def test_hub_sources_are_read_through_the_download_seam_and_their_commits_recorded(tmp_path):
    import shutil

    base, folders, _ = sources(tmp_path, "llama", count=2)
    snapshots = {}
    for i, folder in enumerate(folders):
        snapshot = tmp_path / "hub" / f"models--org--expert{i}" / "snapshots" / f"{i}abc123"
        shutil.copytree(folder, snapshot)
        snapshots[f"org/expert{i}"] = snapshot

    def download(repo_id, revision=None, token=None, allow_patterns=None):
        return str(snapshots[repo_id])

    config = MergeConfig(
        experts=(ExpertSource("org/expert0"), ExpertSource("org/expert1")), base_model=str(base), gate_mode="random"
    )
    out = merge(config, RunOptions(output=str(tmp_path / "hub-merge"), **RUN), download=download).output_dir
    info = json.loads((out / "config.json").read_text())["conversion_info"]["merge"]
    assert [(e["source_model"], e["revision"]) for e in info["experts"]] == [
        ("org/expert0", "0abc123"),
        ("org/expert1", "1abc123"),
    ]
    assert "| 1 | `org/expert1` | 1abc123 |" in (out / "README.md").read_text()

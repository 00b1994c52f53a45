"""`llama-moe analyze`: routing statistics checked against values computed by hand on a model whose routing is
set by hand, every family analysed, and the command's files."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import char_tokenizer, save_tiny_moe, tiny_llama_config

from llama_moe.analysis.analyze import AnalyzeOptions, analyze_model, write_report
from llama_moe.analysis.plots import image_size
from llama_moe.analysis.probes.base import capacity_dropped
from llama_moe.commands import main
from llama_moe.source_families import dense_config_fields
from llama_moe_hf import (
    AttnMoEConfig,
    AttnMoEForCausalLM,
    LlamaMoEConfig,
    LlamaMoEForCausalLM,
    SoapMoEConfig,
    SoapMoEForCausalLM,
)

TOKEN_A, TOKEN_B = 67, 68  # "a" and "b" in the character tokenizer
LOGITS = {TOKEN_A: [2.0, 1.0, 0.0, -1.0], TOKEN_B: [-1.0, 0.0, 1.5, 1.0]}  # top-2: experts {0, 1} and {2, 3}
SITE_FIELDS = {"name", "layer", "kind", "num_experts", "top_k", "load_unit", "domains", "all", "domain_distances"}
SITE_FIELDS |= {"weight_similarity", "output_similarity", "output_similarity_units"}
METRIC_FIELDS = {"units", "load", "load_share", "cv", "entropy", "normalized_entropy", "dropped_share"}


def options(tmp_path, **overrides) -> AnalyzeOptions:
    fields = dict(output=str(tmp_path / "analysis"), max_tokens=256, seq_len=16, batch_size=4, similarity_tokens=64)
    return AnalyzeOptions(**(fields | overrides))


@pytest.fixture(scope="module")
def domains(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("domains")
    (folder / "a.txt").write_text("a" * 2000)
    (folder / "b.txt").write_text("b" * 2000)
    return {"a": str(folder / "a.txt"), "b": str(folder / "b.txt")}


@pytest.fixture(scope="module")
def hand_routed() -> LlamaMoEForCausalLM:
    """One MoE layer whose router input is a one-hot direction per token (attention off: o_proj is zero, and each
    token's embedding is a unit vector), so its router logits are `LOGITS[token]` exactly."""
    torch.manual_seed(0)
    config = LlamaMoEConfig(
        **dense_config_fields(tiny_llama_config(num_hidden_layers=1)),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
    )
    model = LlamaMoEForCausalLM(config).eval()
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        for dim, token in enumerate(LOGITS):
            model.model.embed_tokens.weight[token, dim] = 1.0
            # the norm turns the unit vector e_dim into about sqrt(H) e_dim: the router sees column `dim` scaled
            scale = layer.post_attention_layernorm(model.model.embed_tokens.weight[token])[dim]
            layer.mlp.gate.weight[:, dim] = torch.tensor(LOGITS[token]) / scale
    return model


def by_hand(model, token: int) -> dict:
    """Routing and expert outputs for a text of `token` only, computed from the weights."""
    layer = model.model.layers[0]
    logits = torch.tensor(LOGITS[token])
    probs = logits.softmax(-1)
    selected = logits.topk(2).indices
    state = layer.post_attention_layernorm(model.model.embed_tokens.weight[token])
    experts = layer.mlp.experts
    outputs = []
    for e in range(4):
        gate_up = experts.gate_up_proj[e] @ state
        gate, up = gate_up[:24], gate_up[24:]
        outputs.append(experts.down_proj[e] @ (F.silu(gate) * up))
    return {"probs": probs, "selected": selected, "outputs": torch.stack(outputs).detach()}


def cosine(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.double()
    return (rows @ rows.T) / (rows.norm(dim=1)[:, None] * rows.norm(dim=1)[None, :])


def test_statistics_equal_values_computed_by_hand(hand_routed, domains, tmp_path):
    report = analyze_model(hand_routed, char_tokenizer(), domains, options(tmp_path))
    (site,) = report["sites"]
    assert report["domains"]["a"]["tokens"] == report["domains"]["b"]["tokens"] == 256
    shares = {}
    for name, token in (("a", TOKEN_A), ("b", TOKEN_B)):
        expected = by_hand(hand_routed, token)
        metrics = site["domains"][name]
        load = torch.zeros(4).index_fill_(0, expected["selected"], 256.0)
        assert metrics["load"] == load.tolist()
        assert metrics["cv"] == pytest.approx(1.0)  # [256, 256, 0, 0]: std 128 over mean 128
        entropy = -(expected["probs"] * expected["probs"].log()).sum().item()
        assert metrics["entropy"] == pytest.approx(entropy, rel=1e-5)
        assert metrics["normalized_entropy"] == pytest.approx(entropy / math.log(4), rel=1e-5)
        assert metrics["dropped_share"] is None  # top-k routing has no capacity
        shares[name] = load / load.sum()
    distance = (shares["a"] - shares["b"]).norm().item()
    expected = torch.tensor([[0.0, distance], [distance, 0.0]])
    torch.testing.assert_close(torch.tensor(site["domain_distances"]), expected, atol=1e-6, rtol=0)
    assert distance == pytest.approx(1.0)
    experts = hand_routed.model.layers[0].mlp.experts
    weights = torch.cat([experts.gate_up_proj.flatten(1), experts.down_proj.flatten(1)], 1).detach()
    torch.testing.assert_close(torch.tensor(site["weight_similarity"]), cosine(weights).float(), atol=1e-6, rtol=0)
    # the first 64 tokens are all "a": every expert's output is its output on the "a" state
    assert site["output_similarity_units"] == 64
    outputs = by_hand(hand_routed, TOKEN_A)["outputs"]
    torch.testing.assert_close(torch.tensor(site["output_similarity"]), cosine(outputs).float(), atol=1e-5, rtol=0)


def test_report_files_have_every_field_and_the_expected_image_sizes(hand_routed, domains, tmp_path):
    from matplotlib.image import imread

    report = analyze_model(hand_routed, char_tokenizer(), domains, options(tmp_path))
    write_report(report, tmp_path)
    saved = json.loads((tmp_path / "analysis.json").read_text())
    assert set(saved) == {"family", "domains", "summary", "sites", "plots"}
    assert SITE_FIELDS <= set(saved["sites"][0]) and METRIC_FIELDS <= set(saved["sites"][0]["all"])
    assert saved["plots"] == ["routing_mlp.png", "domain_distances_mlp.png", "expert_similarity_mlp.png"]
    for plot in saved["plots"]:
        height, width = imread(tmp_path / plot).shape[:2]
        assert (width, height) == image_size(1)
    summary = (tmp_path / "summary.md").read_text()  # over both domains every expert has 256 tokens: CV 0
    assert "| 0 | 0.000 |" in summary and "![routing_mlp.png](routing_mlp.png)" in summary


def test_capacity_drops_the_tokens_no_expert_takes():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4]])
    assert capacity_dropped(probs, 1) == 1  # expert 0 takes token 0, expert 1 takes token 2: token 1 is left
    assert capacity_dropped(probs, 3) == 0


def test_expert_choice_gate_reports_its_drops(domains, tmp_path):
    torch.manual_seed(0)
    config = LlamaMoEConfig(
        **dense_config_fields(tiny_llama_config()), num_experts=4, moe_intermediate_size=24, router_type="expert_choice"
    )
    report = analyze_model(LlamaMoEForCausalLM(config).eval(), char_tokenizer(), domains, options(tmp_path))
    for site in report["sites"]:
        assert 0.0 <= site["all"]["dropped_share"] < 1.0


def test_every_family_is_analysed(domains, tmp_path):
    fields = dense_config_fields(tiny_llama_config())
    torch.manual_seed(0)
    attn = AttnMoEForCausalLM(
        AttnMoEConfig(
            **fields,
            num_attention_experts=4,
            num_attention_experts_per_tok=2,
            num_experts=4,
            moe_intermediate_size=24,
            moe_layers=[1],
        )
    ).eval()
    report = analyze_model(attn, char_tokenizer(), domains, options(tmp_path))
    assert [s["name"] for s in report["sites"]] == ["layer 0 attention", "layer 1 attention", "layer 1 mlp"]
    assert set(report["summary"]) == {"attention", "mlp"}
    for site in report["sites"]:
        assert sum(site["all"]["load"]) == 2 * 512  # top-2 of 4 for each of 2 x 256 tokens
        assert len(site["output_similarity"]) == 4 and site["output_similarity"][0][0] == pytest.approx(1.0)


def test_soap_routing_weights_and_utilisation(domains, tmp_path):
    torch.manual_seed(0)
    config = SoapMoEConfig(
        **dense_config_fields(tiny_llama_config()),
        num_experts=4,
        segment_length=8,
        moe_intermediate_size=24,
        utilization_threshold=0.25,
    )
    model = SoapMoEForCausalLM(config).eval()
    tokenizer = char_tokenizer()
    report = analyze_model(model, tokenizer, {"a": domains["a"]}, options(tmp_path))
    ids = torch.tensor(tokenizer("a" * 256)["input_ids"]).view(16, 16)
    with torch.no_grad():
        weights = model(ids[:4], output_routing_weights=True).routing_weights  # every batch is the same text
    for site, layer_weights in zip(report["sites"], weights):
        metrics = site["domains"]["a"]
        assert site["kind"] == "soap" and sum(metrics["mean_routing_weight"]) == pytest.approx(1.0)
        assert metrics["utilization"] == pytest.approx((layer_weights >= 0.25).float().mean().item())


def test_command_writes_the_folder_and_refuses_bad_input(tmp_path, domains, capsys):
    folder = tmp_path / "moe"
    save_tiny_moe(folder)
    output = tmp_path / "analysis"
    argv = ["analyze", str(folder), "--data", f"a={domains['a']}", f"b={domains['b']}", "--output", str(output)]
    argv += ["--max-tokens", "64", "--seq-len", "16", "--similarity-tokens", "16"]
    assert main(argv) == 0
    assert {"analysis.json", "summary.md", "routing_mlp.png"} <= {p.name for p in output.iterdir()}
    assert "mlp (2 layers)" in capsys.readouterr().out
    assert main(argv) == 2 and "exists; pass --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--data", "nonsense"]) == 2
    assert "must be given as NAME=VALUE" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "missing"), "--output", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()

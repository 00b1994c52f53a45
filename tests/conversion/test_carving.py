"""CMoE's carving (`--method carve`) and analytical router (`--router-init analytical`): activation markers, the
balanced assignment, the split, the router, identities with the dense model, split files, real SmolLM2 layers."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_partition,
    assert_same_logits,
    calibrated_split,
    folder_hashes,
    load_moe,
    logits,
    tiny_llama,
    tiny_llama_config,
)

from llama_moe.conversion.calibration import tokenize_calibration
from llama_moe.conversion.methods.carve import carving
from llama_moe.conversion.methods.carve.carving import (
    activation_markers,
    balanced_assignment,
    l1_distances,
    split_carve,
)
from llama_moe.conversion.split_files import load_splits
from llama_moe.export.base import model_reasons
from llama_moe.source_families import dense_config_fields
from llama_moe_hf import LlamaMoEConfig, build_moe, convert_to_moe
from llama_moe_hf.modeling.routers import ROUTER_CLASSES

# ----------------------------------------------------------------------------------------------------------------
# The algorithm


def test_markers_are_each_tokens_largest_normalised_activations(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, gate, up = (torch.randn(n, 16, generator=g) for n in (50, 40, 40))
    markers = activation_markers(x, gate, up, active_neurons=5)
    assert markers.dtype == torch.bool and (markers.sum(1) == 5).all()
    xn, gn, un = (F.normalize(t, dim=1) for t in (x, gate, up))
    activation = (F.silu(xn @ gn.T) * (xn @ un.T)).abs()
    assert torch.equal(markers, activation >= activation.topk(5, dim=1).values[:, -1:])
    # Token scale and row norms do not decide what is active; the chunking changes nothing.
    monkeypatch.setattr(carving, "MARKER_CHUNK_TOKENS", 7)
    assert torch.equal(activation_markers(3 * x, 5 * gate, up / 2, active_neurons=5), markers)
    with pytest.raises(ValueError, match="between 1 and 40"):
        activation_markers(x, gate, up, active_neurons=41)


def test_l1_distances_and_the_balanced_assignment_are_exact():
    g = torch.Generator().manual_seed(1)
    markers, centroids = torch.rand(30, 6, generator=g) < 0.4, torch.rand(30, 3, generator=g)
    torch.testing.assert_close(l1_distances(markers, centroids), torch.cdist(markers.float().T, centroids.T, p=1))
    distances = torch.rand(6, 3, generator=g)
    labels = balanced_assignment(distances, size=2)
    assert torch.bincount(labels).tolist() == [2, 2, 2]
    best = min(distances[range(6), list(p)].sum() for p in itertools.permutations([0, 0, 1, 1, 2, 2]))
    torch.testing.assert_close(distances[range(6), labels].sum(), best)


def planted_markers():
    """Markers `[60, 24]`: 4 neurons active on every token, and 5 groups of 4 neurons, group g active on the tokens
    of type g (t % 5); each group's first neuron (its leader) is also active on 3 other tokens, so the leaders are
    the most often active routed neurons. Returns (markers, group per neuron (-1: always active), leaders)."""
    group = torch.tensor([-1] * 4 + [g for g in range(5) for _ in range(4)])
    group = group[torch.randperm(24, generator=torch.Generator().manual_seed(2))]
    markers = (group[None, :] == torch.arange(60)[:, None] % 5) | (group[None, :] < 0)
    leaders = torch.stack([(group == g).nonzero()[0, 0] for g in range(5)])
    for g, leader in enumerate(leaders):
        markers[(g + 1) % 5 + 5 * torch.arange(3), leader] = True
    return markers, group, leaders


def test_split_carve_shares_the_most_active_and_groups_the_co_active():
    markers, group, leaders = planted_markers()
    split = split_carve(markers, num_experts=5, num_shared_experts=1)
    assert_partition(split, 24)
    assert (
        split.expert_neurons.shape == (5, 4) and split.shared_neurons.tolist() == (group < 0).nonzero()[:, 0].tolist()
    )
    for expert, representative in zip(split.expert_neurons, split.representatives):
        assert group[expert].unique().numel() == 1  # one planted group per expert
        assert representative in expert and representative not in leaders  # the member nearest the group's mean
    assert torch.equal(split.expert_neurons, split_carve(markers, 5, 1).expert_neurons)
    assert split_carve(markers, 6).shared_neurons is None
    with pytest.raises(ValueError, match="not divisible by 7"):
        split_carve(markers, 6, 1)


# ----------------------------------------------------------------------------------------------------------------
# The analytical router


def analytical_router(num_experts=4, top_k=2):
    config = LlamaMoEConfig(
        **dense_config_fields(tiny_llama_config()),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        router_type="analytical",
    )
    router = ROUTER_CLASSES["analytical"](config)
    torch.manual_seed(0)
    for param in (router.weight, router.gate_weight):
        torch.nn.init.normal_(param, std=0.3)  # scores of a few units: no softmax probability underflows to a tie
    return router


def test_analytical_router_scores_by_the_representative_activation_with_unit_weights():
    router = analytical_router()
    x = torch.randn(20, 64)
    scores, weights, index = router(x)
    expected = (F.silu(x @ router.gate_weight.T) * (x @ router.weight.T)).abs()
    torch.testing.assert_close(scores, expected)
    assert torch.equal(index, expected.topk(2, dim=-1).indices) and torch.equal(weights, torch.ones(20, 2))
    with torch.no_grad():  # the load-balancing bias moves the choice, not the weights
        router.e_score_correction_bias[1] = 10.0
    _, weights, index = router(x)
    assert (index == 1).any(-1).all() and torch.equal(weights, torch.ones(20, 2))
    weights.sum().backward()  # fine-tuning reaches the router through the scale (CMoE's extra_scale)
    assert router.weight_scale.grad.abs().sum() > 0
    assert "e_score_correction_bias" in router.state_dict()
    assert "e_score_correction_bias" not in dict(router.named_parameters())


def test_analytical_router_needs_a_carved_split_and_is_not_exported():
    model = tiny_llama()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match=r"picks representative neurons \(carve\), not 'cluster'"):
        build_moe(model, method="cluster", num_experts=4, router_init="analytical", calibration_ids=ids)
    with pytest.raises(ValueError, match="made by router init analytical, not 'random'"):
        build_moe(model, method="carve", router_type="analytical", router_init="random", calibration_ids=ids)
    assert "router_type 'analytical': CMoE's router" in model_reasons(LlamaMoEConfig(router_type="analytical"))[0]


# ----------------------------------------------------------------------------------------------------------------
# Whole models


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama()
    input_ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(5))
    return model, input_ids


@pytest.mark.parametrize("compensation", [False, True])
def test_every_expert_on_with_unit_weights_is_the_dense_model(tiny, compensation):
    model, input_ids = tiny
    moe = build_moe(
        model,
        method="carve",
        num_experts=3,
        num_shared_experts=1,
        top_k=3,
        compensation=compensation,
        carve_active_neurons=8,
        calibration_ids=input_ids,
    )
    assert moe.config.router_type == "analytical" and moe.config.score_scale_factor == 1.0
    assert_same_logits(moe, model, input_ids, 1e-5)


def test_a_carved_split_takes_the_selector_and_compensation(tiny):
    model, input_ids = tiny
    fields = dict(method="carve", num_experts=3, num_shared_experts=1, compensation=True, calibration_ids=input_ids)
    selector = build_moe(model, top_k=3, router_init="selector", selector_steps=2, **fields)
    assert selector.config.router_type == "selector" and selector.config.score_scale_factor == 1.0
    assert_same_logits(selector, model, input_ids, 1e-5)
    analytical = build_moe(model, top_k=1, **fields)
    for name in ("experts.down_proj", "shared_experts.down_proj.weight", "compensation"):  # the same experts
        name = f"model.layers.1.mlp.{name}"
        assert torch.equal(selector.get_parameter(name), analytical.get_parameter(name))
    assert not torch.allclose(logits(analytical, input_ids), logits(model, input_ids), atol=1e-3)


def test_converter_carve_split_file_round_trip(tiny_dense, tiny_calibration, tmp_path):
    dense_path, input_ids, reference = tiny_dense
    split_file = str(tmp_path / "split.safetensors")
    common = dict(
        method="carve",
        num_experts=3,
        num_shared_experts=1,
        calibration_data=str(tiny_calibration),
        calibration_tokens=512,
        calibration_seq_len=32,
        progress=False,
        eval=False,
    )
    first = convert_to_moe(dense_path, tmp_path / "a", top_k=1, save_split=split_file, **common)
    splits, _, metadata = load_splits(split_file)
    assert metadata["method"] == "carve" and sorted(splits) == [0, 1]
    for split in splits.values():
        assert_partition(split, 96)
        assert (split.expert_neurons == split.representatives[:, None]).any(1).all()
    common["calibration_data"] = "not-used"
    again = convert_to_moe(dense_path, tmp_path / "b", top_k=1, load_split=split_file, **common)
    assert folder_hashes(again.output_dir)["model.safetensors"] == folder_hashes(first.output_dir)["model.safetensors"]
    every = convert_to_moe(dense_path, tmp_path / "c", top_k=3, load_split=split_file, **common)
    torch.testing.assert_close(logits(load_moe(every.output_dir), input_ids), reference, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_carving_real_smollm2_layers(smollm2, real_text):
    """Two real layers, 1024 calibration tokens: a partition into 1 shared + 7 routed experts of 192 neurons, the
    shared ones the most often active, each routed expert's router row its representative's normalised rows, and
    every expert on the dense model."""
    model, tokenizer = smollm2
    ids = tokenize_calibration(real_text, tokenizer, num_tokens=1024, seq_len=256)
    fields = dict(method="carve", num_experts=7, num_shared_experts=1, moe_layers=["3,28"], calibration_samples=1024)
    splits, context = calibrated_split(model, ids, **fields)
    moe = build_moe(model, context=context, top_k=7, **fields)
    for i, split in splits.items():
        mlp = model.model.layers[i].mlp
        assert_partition(split, 1536)
        assert split.expert_neurons.shape == (7, 192) and split.shared_neurons.shape == (192,)
        markers = activation_markers(context.mlp(i).hidden_states, mlp.gate_proj.weight, mlp.up_proj.weight, 10)
        rates = markers.float().mean(0)
        assert rates[split.shared_neurons].min() >= rates[split.expert_neurons].max() > 0
        gate = moe.model.layers[i].mlp.gate
        torch.testing.assert_close(gate.weight, F.normalize(mlp.up_proj.weight[split.representatives], dim=1))
        torch.testing.assert_close(gate.gate_weight, F.normalize(mlp.gate_proj.weight[split.representatives], dim=1))
    assert_same_logits(moe, model, ids[:1, :64], 1e-4)

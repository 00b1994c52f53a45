"""Calibration-based expert construction: balanced clustering, importance splits, split files, layer patterns."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_partition, assert_same_logits, calibrated_split, load_moe, logits, tiny_llama

from llama_moe.conversion.calibration import tokenize_calibration
from llama_moe.conversion.experts import ExpertSplit
from llama_moe.conversion.layer_patterns import parse_moe_layers
from llama_moe.conversion.methods.cluster.clustering import (
    balanced_kmeans,
    kmeans_router,
    sample_rows,
    split_cluster,
)
from llama_moe.conversion.methods.shared.importance import (
    assign_by_importance,
    split_sharing_inner,
    split_sharing_inter,
)
from llama_moe.conversion.split_files import check_loaded_split, load_splits, save_splits
from llama_moe.perplexity import sliding_window_perplexity
from llama_moe.text.documents import load_texts
from llama_moe_hf import MoERecipe, build_moe, convert_to_moe


def planted_rows(num_groups=4, per_group=8, dim=16, seed=0):
    """Rows around `num_groups` random directions, shuffled; returns (rows [n, dim], true group [n])."""
    g = torch.Generator().manual_seed(seed)
    directions = F.normalize(torch.randn(num_groups, dim, generator=g), dim=1)
    groups = torch.arange(num_groups).repeat_interleave(per_group)
    order = torch.randperm(groups.numel(), generator=g)
    groups = groups[order]
    noise = 0.05 * torch.randn(groups.numel(), dim, generator=g)
    rows = (directions[groups] + noise) * (1 + torch.rand(groups.numel(), 1, generator=g))  # norms vary
    return rows, groups


def same_grouping(expert_neurons: torch.Tensor, truth: torch.Tensor) -> bool:
    return all(truth[row].unique().numel() == 1 for row in expert_neurons)


def test_balanced_kmeans_is_balanced_deterministic_and_finds_clusters():
    rows, truth = planted_rows()
    labels, centroids = balanced_kmeans(rows, 4, seed=3)
    assert torch.bincount(labels).tolist() == [8, 8, 8, 8] and centroids.shape == (4, 16)
    assert torch.equal(labels, balanced_kmeans(rows, 4, seed=3)[0])
    assert all(truth[labels == c].unique().numel() == 1 for c in range(4))
    uneven, _ = balanced_kmeans(rows[:30], 4)
    assert sorted(torch.bincount(uneven).tolist()) == [7, 7, 8, 8]
    with pytest.raises(ValueError, match="at least 4 points"):
        balanced_kmeans(rows[:3], 4)


def test_split_cluster_on_activations_groups_neurons_that_fire_on_the_same_tokens():
    from types import SimpleNamespace

    # 4 token types along the first 4 axes; a neuron of group g fires (silu(5 x_g) * x_g) only on type-g tokens,
    # while its gate and up rows alone would not tell the groups apart after row normalisation noise.
    g = torch.Generator().manual_seed(0)
    truth = torch.randperm(32, generator=g) % 4  # [I]
    axes = torch.eye(16)[truth]  # [I, H]
    gate = 5 * axes + 0.3 * torch.randn(32, 16, generator=g)
    up = axes + 0.3 * torch.randn(32, 16, generator=g)
    down = torch.randn(16, 32, generator=g)
    hidden = torch.eye(16)[torch.randint(0, 4, (400,), generator=g)] * (1 + torch.rand(400, 1, generator=g))
    mean = (F.silu(hidden @ gate.T) * (hidden @ up.T)).mean(0)
    calibration = SimpleNamespace(hidden_states=hidden, mean_activation=mean)
    split = split_cluster(gate, up, 4, cluster_on="activations", down_proj=down, calibration=calibration)
    assert_partition(split, 32)
    assert same_grouping(split.expert_neurons, truth)
    again = split_cluster(gate, up, 4, cluster_on="activations", down_proj=down, calibration=calibration)
    assert torch.equal(split.expert_neurons, again.expert_neurons)
    with pytest.raises(ValueError, match="needs calibration data"):
        split_cluster(gate, up, 4, cluster_on="activations")


def test_sample_rows_is_a_seeded_subset_without_repeats():
    rows = torch.arange(40.0).view(20, 2)
    sample = sample_rows(rows, 8, seed=3)
    assert sample.shape == (8, 2)
    assert len({tuple(row.tolist()) for row in sample}) == 8  # distinct rows of the input
    assert all(row.tolist() in rows.tolist() for row in sample)
    assert torch.equal(sample, sample_rows(rows, 8, seed=3))
    assert not torch.equal(sample, sample_rows(rows, 8, seed=4))
    assert sample_rows(rows, 20, seed=3) is rows  # small enough: all rows, in order


def test_kmeans_router_uses_a_seeded_subset_of_at_most_max_points():
    rows, truth = planted_rows()
    router = kmeans_router(rows, 4, seed=1, max_points=16)
    assert router.shape == (4, 16)
    assert torch.equal(router, kmeans_router(rows, 4, seed=1, max_points=16))
    assert not torch.equal(router, kmeans_router(rows, 4, seed=1))  # all 32 points give other centroids


@pytest.mark.parametrize("cluster_on", ["gate", "up", "both"])
def test_split_cluster_groups_rows_that_point_the_same_way(cluster_on):
    rows, truth = planted_rows()
    noise = torch.randn(rows.shape, generator=torch.Generator().manual_seed(9))
    gate, up = (rows, noise) if cluster_on == "gate" else (noise, rows) if cluster_on == "up" else (rows, rows)
    split = split_cluster(gate, up, 4, cluster_on=cluster_on)
    assert_partition(split, 32)
    assert split.expert_neurons.shape == (4, 8) and split.shared_neurons is None
    assert same_grouping(split.expert_neurons, truth)
    assert torch.equal(split.expert_neurons, split_cluster(gate, up, 4, cluster_on=cluster_on).expert_neurons)


def test_split_cluster_errors():
    rows, _ = planted_rows()
    with pytest.raises(ValueError, match="--cluster-on must be one of"):
        split_cluster(rows, rows, 4, cluster_on="down")
    with pytest.raises(ValueError, match="not divisible by 5"):
        split_cluster(rows, rows, 5)


def planted_importance(num_groups=4, intermediate_size=32, seed=0):
    """Random importances where neurons 0..3 matter to every group, neuron 4+g mostly to group g."""
    importance = torch.rand(num_groups, intermediate_size, generator=torch.Generator().manual_seed(seed))
    importance[:, :4] += 5
    for g in range(num_groups):
        importance[g, 4 + g] += 3
    return importance


def test_sharing_inner_takes_each_groups_top_neurons():
    importance = planted_importance()
    split = split_sharing_inner(importance, expert_size=10)
    assert split.expert_neurons.shape == (4, 10) and split.shared_neurons is None
    for g in range(4):
        assert set(split.expert_neurons[g].tolist()) == set(importance[g].topk(10).indices.tolist())
        assert {0, 1, 2, 3, 4 + g} <= set(split.expert_neurons[g].tolist())  # the documented overlap
    with pytest.raises(ValueError, match="between 1 and 32"):
        split_sharing_inner(importance, expert_size=33)


def test_sharing_inter_puts_the_most_shared_neurons_in_the_shared_expert():
    importance = planted_importance(num_groups=3, intermediate_size=24)
    split = split_sharing_inter(importance, num_shared_experts=1)
    assert_partition(split, 24)
    assert split.expert_neurons.shape == (3, 6) and split.shared_neurons.shape == (6,)
    assert {0, 1, 2, 3} <= set(split.shared_neurons.tolist())
    for g in range(3):  # each group's favourite neuron stays with its expert unless it is shared
        assert 4 + g in split.expert_neurons[g] or 4 + g in split.shared_neurons
    assert torch.equal(split.expert_neurons, split_sharing_inter(importance, 1).expert_neurons)
    no_shared = split_sharing_inter(importance, num_shared_experts=0)
    assert_partition(no_shared, 24)
    assert no_shared.shared_neurons is None and no_shared.expert_neurons.shape == (3, 8)


def test_assign_by_importance_is_a_balanced_partition():
    importance = torch.zeros(2, 6)
    importance[0, [0, 1, 2, 3]] = 1.0  # expert 0 wants four neurons but has room for three
    importance[1, 5] = 1.0
    neurons = torch.arange(6)
    owners = assign_by_importance(importance, neurons, expert_size=3)
    assert owners[0].tolist() == [0, 1, 2] and owners[1].tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="Cannot partition 6 neurons"):
        assign_by_importance(importance, neurons, expert_size=2)


def test_split_files_round_trip(tmp_path):
    splits = {
        0: ExpertSplit(torch.arange(8).view(2, 4)),
        3: ExpertSplit(torch.arange(6).view(2, 3), shared_neurons=torch.tensor([6, 7])),
    }
    routers = {3: torch.randn(2, 5)}
    path = tmp_path / "sub" / "split.safetensors"
    save_splits(path, splits, routers, metadata={"method": "residual"})
    assert [p.name for p in path.parent.iterdir()] == ["split.safetensors"]  # no temporary file left
    loaded, loaded_routers, metadata = load_splits(path)
    assert loaded.keys() == splits.keys() and metadata["method"] == "residual"
    for i in splits:
        assert torch.equal(loaded[i].expert_neurons, splits[i].expert_neurons)
    assert torch.equal(loaded[3].shared_neurons, splits[3].shared_neurons) and loaded[0].shared_neurons is None
    assert torch.equal(loaded_routers[3], routers[3]) and 0 not in loaded_routers

    check_loaded_split(loaded[0], 0, intermediate_size=8, num_experts=2, expert_size=4)
    with pytest.raises(ValueError, match="needs 4 of 2"):
        check_loaded_split(loaded[0], 0, intermediate_size=8, num_experts=4, expert_size=2)
    with pytest.raises(ValueError, match="outside 0..5"):
        check_loaded_split(loaded[0], 0, intermediate_size=6, num_experts=2, expert_size=4)


def test_bad_split_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_splits(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors split file"):
        load_splits(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(2)}, tmp_path / "weights.safetensors")
    with pytest.raises(ValueError, match="not a llama-moe-hf split file"):
        load_splits(tmp_path / "weights.safetensors")


@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, list(range(8))),
        ("all", list(range(8))),
        ("0,2,5", [0, 2, 5]),
        ("0-3", [0, 1, 2, 3]),
        ("last:2", [6, 7]),
        ("first:2, last:1", [0, 1, 7]),
        ("every:2", [0, 2, 4, 6]),
        ("every:3:1", [1, 4, 7]),
        ("1,1,0-1", [0, 1]),
        ("0 2 5", [0, 2, 5]),  # as --help writes it (read as layer 25 until 0.4.1)
        (["0", "2-3", "last:1"], [0, 2, 3, 7]),  # `--moe-layers 0 2-3 last:1`
    ],
)
def test_parse_moe_layers(spec, expected):
    assert parse_moe_layers(spec, 8) == expected


@pytest.mark.parametrize(
    "spec, message",
    [
        ("8", "layers 0..7"),
        ("last:9", "has 8 layers"),
        ("3-1", "is empty"),
        ("every:0", "at least 1"),
        ("odd", "Cannot read"),
    ],
)
def test_parse_moe_layers_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_moe_layers(spec, 8)


# ----------------------------------------------------------------------------------------------------------------
# Whole-model construction on a tiny random LLaMA
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama()
    input_ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(5))
    return model, input_ids


@pytest.mark.parametrize(
    "method, num_experts, num_shared",
    [("cluster", 4, 0), ("sharing-inter", 4, 0), ("sharing-inter", 3, 1), ("residual", 3, 1), ("residual", 4, 0)],
)
def test_partition_methods_are_deterministic_partitions_equal_to_dense(tiny, method, num_experts, num_shared):
    model, input_ids = tiny
    fields = dict(method=method, num_experts=num_experts, num_shared_experts=num_shared)
    splits, context = calibrated_split(model, input_ids, **fields)
    again, _ = calibrated_split(model, input_ids, **fields)
    size = 96 // (num_experts + num_shared)
    for i in (0, 1):
        assert_partition(splits[i], 96)
        assert splits[i].expert_neurons.shape == (num_experts, size)
        assert (splits[i].shared_neurons is None) == (num_shared == 0)
        assert torch.equal(splits[i].expert_neurons, again[i].expert_neurons)
    assert context.has_kmeans_centroids([0, 1], num_experts) == (method == "residual")
    everything = dict(top_k=num_experts, router_init="zero", score_scale_factor=float(num_experts))
    assert_same_logits(build_moe(model, calibration_ids=input_ids, **fields, **everything), model, input_ids, 1e-5)


def test_sharing_inner_and_kmeans_routers(tiny):
    model, input_ids = tiny
    moe = build_moe(
        model, method="sharing-inner", num_experts=4, moe_layers=["1"], router_init="kmeans", calibration_ids=input_ids
    )
    splits, context = calibrated_split(model, input_ids, method="sharing-inner", num_experts=4, moe_layers=["1"])
    assert splits[1].expert_neurons.shape == (4, 24)
    assert all(row.unique().numel() == 24 for row in splits[1].expert_neurons)
    assert torch.equal(moe.model.layers[1].mlp.gate.weight, context.kmeans_centroids(1, 4))


def test_calibrated_methods_refuse_what_they_cannot_build(tiny):
    model, input_ids = tiny
    with pytest.raises(ValueError, match="not supported with method 'cluster'"):
        build_moe(model, method="cluster", num_experts=3, num_shared_experts=1, calibration_ids=input_ids)
    with pytest.raises(ValueError, match="at least 8 sequences"):
        build_moe(model, method="sharing-inner", num_experts=8, calibration_ids=input_ids[:4])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        build_moe(model, method="residual", num_experts=4)


@pytest.mark.slow
def test_residual_on_smollm2_with_the_builtin_corpus(smollm2):
    """One short real run: 2 layers, 4 x 64 calibration tokens of real text."""
    model, tokenizer = smollm2
    texts, _ = load_texts(None)
    input_ids = tokenize_calibration(texts, tokenizer, num_tokens=256, seq_len=64)
    splits, context = calibrated_split(
        model,
        input_ids,
        method="residual",
        num_experts=7,
        num_shared_experts=1,
        moe_layers=["28,29"],
        calibration_samples=256,
    )
    for i in (28, 29):
        assert_partition(splits[i], 1536)
        assert splits[i].expert_neurons.shape == (7, 192) and splits[i].shared_neurons.shape == (192,)
        assert context.kmeans_centroids(i, 7).shape == (7, 576)


@pytest.mark.slow
def test_residual_defaults_are_not_a_trap_on_smollm2(smollm2, real_text):
    """`--method residual --num-experts 7 --num-shared-experts 1 --top-k 1` with nothing else set: LLaMA-MoE v1's N/k
    score scale multiplied the one routed expert by 7 (544,043x the dense perplexity over all layers); now 1."""
    from llama_moe.conversion.plan import resolve_recipe

    model, tokenizer = smollm2
    fields = dict(method="residual", num_experts=7, num_shared_experts=1, top_k=1)
    assert resolve_recipe(MoERecipe(**fields)).score_scale_factor == 1.0
    assert resolve_recipe(MoERecipe(method="random", num_experts=8, top_k=2)).score_scale_factor == 4.0  # v1's
    ids = tokenize_calibration(real_text[-40:], tokenizer, num_tokens=512, seq_len=256).flatten()
    moe = build_moe(model, tokenizer=tokenizer, moe_layers=["last:8"], calibration_tokens=1024, **fields)
    ratio = (
        sliding_window_perplexity(moe, ids, 256, 256).perplexity
        / sliding_window_perplexity(model, ids, 256, 256).perplexity
    )
    assert ratio < 3, ratio  # with the old default: over 100x


# ----------------------------------------------------------------------------------------------------------------
# Through the converter, on real files
# ----------------------------------------------------------------------------------------------------------------


def test_converter_residual_split_file_round_trip_and_dense_identity(
    tiny_dense, tiny_calibration, tmp_path, caplog, capfd
):
    from safetensors.torch import load_file

    dense_path, input_ids, reference = tiny_dense
    common = dict(
        method="residual",
        num_experts=3,
        num_shared_experts=1,
        calibration_data=str(tiny_calibration),
        calibration_tokens=512,
        calibration_seq_len=32,
        moe_layers="last:1",
        progress=False,
    )
    with caplog.at_level("INFO", logger="llama_moe"):
        split_file = str(tmp_path / "split.safetensors")
        first = convert_to_moe(dense_path, tmp_path / "a", top_k=1, save_split=split_file, **common)
    logged = f"Calibration data: local file {tiny_calibration} (1 docs) -> 16 sequences of 32 tokens."
    assert logged in caplog.text
    assert "Loading weights" not in capfd.readouterr().err  # progress=False silences transformers' bars too
    splits, routers, metadata = load_splits(tmp_path / "split.safetensors")
    assert list(splits) == [1] and metadata["method"] == "residual"
    assert_partition(splits[1], 96)
    weights = load_file(first.output_dir / "model.safetensors")
    assert torch.equal(weights["model.layers.1.mlp.gate.weight"], routers[1])  # v2 routes by the k-means centroids
    assert "model.layers.0.mlp.gate_proj.weight" in weights  # layer 0 stays dense

    # The same split, read back, with every expert on, a zero router and scale N: exactly the dense model.
    second = convert_to_moe(
        dense_path,
        tmp_path / "b",
        top_k=3,
        router_init="zero",
        score_scale_factor=3.0,
        load_split=str(tmp_path / "split.safetensors"),
        **{**common, "calibration_data": "not-used"},
    )
    reread = load_file(second.output_dir / "model.safetensors")
    assert torch.equal(reread["model.layers.1.mlp.experts.down_proj"], weights["model.layers.1.mlp.experts.down_proj"])
    torch.testing.assert_close(logits(load_moe(second.output_dir), input_ids), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "method, cluster_on", [("cluster", "both"), ("cluster", "activations"), ("sharing-inter", None)]
)
def test_converter_kmeans_router_and_dense_identity(tiny_dense, tiny_calibration, tmp_path, method, cluster_on):
    from safetensors.torch import load_file

    dense_path, input_ids, reference = tiny_dense
    fields = dict(
        method=method,
        num_experts=4,
        top_k=4,
        score_scale_factor=4.0,
        calibration_data=str(tiny_calibration),
        calibration_tokens=256,
        calibration_seq_len=32,
        progress=False,
    )
    fields.update({"cluster_on": cluster_on} if cluster_on else {})
    result = convert_to_moe(dense_path, tmp_path / "moe", router_init="kmeans", **fields)
    weights = load_file(result.output_dir / "model.safetensors")
    assert weights["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    # With a k-means router the top-4 weights are not uniform, so compare with the zero router for the identity.
    zero = convert_to_moe(dense_path, tmp_path / "zero", router_init="zero", **fields)
    torch.testing.assert_close(logits(load_moe(zero.output_dir), input_ids), reference, atol=1e-4, rtol=0)


def test_one_load_and_one_pass_for_every_calibrated_component(tiny_dense, tiny_calibration, tmp_path, monkeypatch):
    """MLP experts clustered on activations with a selector and compensation, plus attention routers fitted on
    calibration text: one pass over the dense model's layers, read from the checkpoint one at a time; the whole model
    is never loaded. (The check after the write, off here, loads it: tests/conversion/test_convert.py.)"""
    from llama_moe.checkpoints.folder import FolderSource
    from llama_moe.conversion import calibration

    loads, passes = [], []
    load_model, collect = FolderSource.load_model, calibration.collect_calibration
    monkeypatch.setattr(FolderSource, "load_model", lambda self, *args: loads.append(1) or load_model(self, *args))
    monkeypatch.setattr(calibration, "collect_calibration", lambda *a, **k: passes.append(k) or collect(*a, **k))
    dense_path, _, _ = tiny_dense
    result = convert_to_moe(
        dense_path,
        tmp_path / "moe",
        mlp_moe=True,
        method="cluster",
        cluster_on="activations",
        num_experts=4,
        router_init="selector",
        compensation=True,
        selector_steps=2,
        family="attn_moe",
        attn_experts=2,
        attn_top_k=1,
        attn_router_init="fit",
        calibration_data=str(tiny_calibration),
        calibration_tokens=256,
        calibration_seq_len=32,
        progress=False,
        eval=False,
    )
    assert loads == [] and len(passes) == 1
    assert passes[0]["attention_experts"] == {0: 2, 1: 2} and not passes[0].get("with_gradients")
    model = load_moe(result.output_dir)
    assert model.config.router_type == "selector" and model.config.moe_compensation
    assert model.model.layers[1].self_attn.gate.weight.abs().sum() > 0


def test_converter_rejects_bad_calibrated_settings(tiny_dense, tiny_calibration, tmp_path):
    dense_path, _, _ = tiny_dense
    with pytest.raises(ValueError, match="--save-split / --load-split work with the methods carve, cluster"):
        convert_to_moe(dense_path, tmp_path / "a", method="random", save_split=str(tmp_path / "s.safetensors"))
    # Before the (missing) source is opened:
    with pytest.raises(ValueError, match="--selector-objective must be one of listwise, bce, got 'mse'"):
        convert_to_moe(
            tmp_path / "no-such-model",
            tmp_path / "b",
            method="cluster",
            router_init="selector",
            selector_objective="mse",
        )
    with pytest.raises(ValueError, match="--selector-objective applies to router initialisation 'selector'"):
        convert_to_moe(tmp_path / "no-such-model", tmp_path / "b", method="cluster", selector_objective="bce")
    with pytest.raises(ValueError, match="--cluster-on must be one of gate, up, both, activations"):
        convert_to_moe(tmp_path / "no-such-model", tmp_path / "b", method="cluster", num_experts=4, cluster_on="down")
    with pytest.raises(ValueError, match="fewer than one sequence of 100000"):
        convert_to_moe(
            dense_path,
            tmp_path / "c",
            method="residual",
            num_experts=4,
            calibration_seq_len=100_000,
            calibration_tokens=100_000,
            calibration_data=str(tiny_calibration),
            progress=False,
        )
    with pytest.raises(ValueError, match="names layers \\[7\\]"):
        convert_to_moe(dense_path, tmp_path / "d", method="cluster", num_experts=4, moe_layers="0,7")
    with pytest.raises(ValueError, match="--calibration-samples must be at least 1"):
        convert_to_moe(dense_path, tmp_path / "e", method="cluster", num_experts=4, calibration_samples=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written

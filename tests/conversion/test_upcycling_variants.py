"""Upcycling variants: fine-grained upcycling (E copies cut into G pieces each, the copy's router row repeated) equals
the dense model whatever the router weights; Drop-Upcycling re-initialises exactly round(r * I) neurons of each expert,
seeded, and says that its model is not the dense one."""

import pytest
import torch
import yaml
from helpers import (
    FAMILY_CONFIGS,
    assert_same_logits,
    folder_hashes,
    load_moe,
    logits,
    one_error_line,
    tiny_llama,
    tiny_llama_config,
    tiny_source,
    token_batch,
)

from llama_moe.commands import main
from llama_moe.conversion.plan import ConversionPlan
from llama_moe_hf import MoERecipe, build_moe, convert_to_moe, load_recipe

FINE = dict(method="fine_grained_upcycle", num_experts=4, top_k=2)
DROP = dict(method="drop_upcycle", num_experts=4, top_k=2)
INTERMEDIATE = tiny_llama_config().intermediate_size  # 96


def plan(**fields) -> ConversionPlan:
    return ConversionPlan.create(MoERecipe.from_dict(fields), tiny_llama_config())


def randomise_routers(moe, pieces: int) -> None:
    """Routers far from uniform, each copy's row repeated for its pieces (the structure the conversion writes)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in moe.model.layers:
            weight = layer.mlp.gate.weight
            rows = torch.randn(weight.shape[0] // pieces, weight.shape[1], generator=generator)
            weight.copy_(rows.repeat_interleave(pieces, dim=0))


@pytest.mark.parametrize(
    "family, pieces", [(family, 2) for family in FAMILY_CONFIGS] + [("llama", 3), ("qwen3", 3), ("llama", 4)]
)
def test_fine_grained_upcycling_equals_the_dense_model(family, pieces):
    dense = tiny_source(family)
    moe = build_moe(dense, **FINE, upcycle_granularity=pieces)
    config = moe.config
    assert (config.num_experts, config.num_experts_per_tok) == (4 * pieces, 2 * pieces)
    assert config.moe_intermediate_size == INTERMEDIATE // pieces and config.score_scale_factor == pieces
    gate = moe.model.layers[0].mlp.gate.weight.view(4, pieces, -1)
    assert torch.equal(gate, gate[:, :1].expand_as(gate))  # copy e's row for each of its pieces
    input_ids = token_batch(length=12)
    assert_same_logits(moe, dense, input_ids, atol=1e-5)
    randomise_routers(moe, pieces)
    assert_same_logits(moe, dense, input_ids, atol=1e-5)


def test_the_top_k_picks_whole_copies_and_the_scale_matters():
    pieces, dense = 3, tiny_llama()
    moe = build_moe(dense, **FINE, upcycle_granularity=pieces)
    randomise_routers(moe, pieces)
    _, weights, index = moe.model.layers[0].mlp.gate(torch.randn(64, 64, generator=torch.Generator().manual_seed(2)))
    copies, weights = (index // pieces).view(64, 2, pieces), weights.view(64, 2, pieces)  # sorted: ties adjacent
    assert torch.equal(copies, copies[..., :1].expand_as(copies))  # each chosen copy with all its pieces
    assert torch.equal(weights, weights[..., :1].expand_as(weights))  # p_e / G each
    assert len({tuple(row[:, 0].tolist()) for row in copies}) > 1  # and the choice depends on the token
    halved = build_moe(dense, **FINE, upcycle_granularity=pieces, score_scale_factor=0.5)
    assert halved.config.score_scale_factor == 1.5  # the recipe's scale is per copy
    with pytest.raises(AssertionError):
        assert_same_logits(halved, dense, token_batch(length=12), atol=1e-3)


def test_a_converted_folder_keeps_the_copies_in_its_recipe_and_the_pieces_in_its_config(tiny_dense, tmp_path):
    dense_path, input_ids, reference = tiny_dense
    first, second = tmp_path / "first", tmp_path / "second"
    convert_to_moe(dense_path, first, **FINE, upcycle_granularity=3, eval=False, progress=False)
    recipe = yaml.safe_load((first / "moe_recipe.yaml").read_text())
    assert (recipe["num_experts"], recipe["top_k"], recipe["upcycle_granularity"]) == (4, 2, 3)
    model = load_moe(first)
    assert (model.config.num_experts, model.config.num_experts_per_tok, model.config.score_scale_factor) == (12, 6, 3)
    torch.testing.assert_close(logits(model, input_ids), reference, atol=1e-5, rtol=1e-4)
    assert "12 experts are 4 copies of the dense FFN, each cut into 3 pieces" in (first / "README.md").read_text()
    convert_to_moe(dense_path, second, load_recipe(first / "moe_recipe.yaml")[0], eval=False, progress=False)
    assert folder_hashes(first)["model.safetensors"] == folder_hashes(second)["model.safetensors"]


def test_fine_grained_upcycling_with_a_noisy_gate():
    dense = tiny_llama()
    moe = build_moe(dense, **FINE, router_type="noisy_top_k")
    assert moe.model.layers[0].mlp.gate.noise_weight.shape == (8, 64)
    assert_same_logits(moe, dense, token_batch(length=12), atol=1e-5)


@pytest.mark.parametrize("pieces", [5, 0, 192])
def test_a_granularity_that_does_not_divide_the_ffn_is_one_error(pieces):
    with pytest.raises(ValueError, match="--upcycle-granularity must be a positive divisor") as error:
        plan(**FINE, upcycle_granularity=pieces)
    assert "\n" not in str(error.value) and str(pieces) in str(error.value)


def test_the_command_line_says_so_in_one_line(tiny_dense, tmp_path, capsys):
    argv = ["convert", "--model", str(tiny_dense[0]), "--output", str(tmp_path / "moe"), "--no-progress"]
    assert main([*argv, "--method", "fine_grained_upcycle", "--upcycle-granularity", "5"]) == 2
    assert one_error_line(capsys) == (
        "error: --upcycle-granularity must be a positive divisor of the FFN's 96 neurons, got 5."
    )
    assert not (tmp_path / "moe").exists()


def reinitialised(moe, dense, layer: int = 0) -> torch.Tensor:
    """`[E, I]`: the neurons of each expert whose gate row, up row and down column all differ from the dense ones
    (checked to be the same neurons in the three, every other neuron equal to the dense one)."""
    experts, mlp = moe.model.layers[layer].mlp.experts, dense.model.layers[layer].mlp
    gate, up = experts.gate_up_proj.split(INTERMEDIATE, dim=1)  # [E, I, H] each
    masks = []
    for expert, dense_weight in ((gate, mlp.gate_proj.weight), (up, mlp.up_proj.weight)):
        masks.append((expert != dense_weight).all(-1))
        assert torch.equal(masks[-1], (expert != dense_weight).any(-1))  # a neuron is kept or redrawn, whole
    down = experts.down_proj  # [E, H, I]
    masks.append((down != mlp.down_proj.weight).all(1))
    assert torch.equal(masks[-1], (down != mlp.down_proj.weight).any(1))
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])
    return masks[0]


@pytest.mark.parametrize("ratio", [0.5, 0.3, 1.0])
def test_drop_upcycling_redraws_round_r_i_neurons_of_each_expert(ratio):
    dense = tiny_llama()
    moe = build_moe(dense, **DROP, drop_ratio=ratio)
    assert (moe.config.num_experts, moe.config.moe_intermediate_size, moe.config.score_scale_factor) == (4, 96, 1.0)
    for layer in range(2):
        mask = reinitialised(moe, dense, layer)
        assert mask.sum(1).tolist() == [round(ratio * INTERMEDIATE)] * 4
        if ratio < 1:
            assert len({tuple(row.tolist()) for row in mask}) == 4  # each expert its own neurons
    gate = moe.model.layers[0].mlp.experts.gate_up_proj[:, :INTERMEDIATE][reinitialised(moe, dense)]
    dense_gate = dense.model.layers[0].mlp.gate_proj.weight
    torch.testing.assert_close(gate.std(), dense_gate.std(), rtol=0.05, atol=0)  # the dense matrix's statistics
    torch.testing.assert_close(gate.mean(), dense_gate.mean(), rtol=0, atol=0.1 * dense_gate.std().item())


def test_drop_upcycling_is_seeded_and_not_the_dense_model():
    dense = tiny_llama()
    first, again, other = (build_moe(dense, **DROP, seed=seed) for seed in (0, 0, 1))
    state = first.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in again.state_dict().items())
    assert not torch.equal(reinitialised(first, dense), reinitialised(other, dense))
    input_ids = token_batch(length=12)
    assert not torch.allclose(logits(first, input_ids), logits(dense, input_ids), atol=1e-3)
    note = plan(**DROP, drop_ratio=0.25).components["mlp"][0].card_note()
    assert "25% of its neurons re-initialised" in note and "does not compute what the dense model computes" in note


@pytest.mark.parametrize("ratio", [0, -0.5, 1.5])
def test_a_drop_ratio_outside_zero_to_one_is_one_error(ratio):
    with pytest.raises(ValueError, match=r"--drop-ratio must be in \(0, 1\]"):
        plan(**DROP, drop_ratio=ratio)


def test_convert_help_lists_the_variants(capsys):
    assert main(["convert", "--help"]) == 0
    text = capsys.readouterr().out
    for expected in ("fine_grained_upcycle", "--upcycle-granularity", "drop_upcycle", "--drop-ratio"):
        assert expected in text

"""G-MoEfication: compensation identities, the selector router, the oracle, on tiny models and on real SmolLM2."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_llama_config
from transformers.models.llama.modeling_llama import LlamaMLP

from llama_moe.conversion.calibration import tokenize_calibration
from llama_moe.conversion.experts import build_expert_tensors, split_random
from llama_moe.conversion.routers.selector import gmoefication as g
from llama_moe.conversion.statistics import collect_calibration
from llama_moe_hf import LlamaMoEConfig, LlamaMoEForCausalLM
from llama_moe_hf.modeling.modeling_llama_moe import LlamaMoESparseMoeBlock

NUM_EXPERTS = 4


def moe_config(**overrides) -> LlamaMoEConfig:
    fields = tiny_llama_config().to_dict()
    fields.update(num_experts=NUM_EXPERTS, router_type="selector", moe_compensation=True)
    fields.update(overrides)
    return LlamaMoEConfig(**fields)


def dense_mlp(config, seed=0) -> LlamaMLP:
    torch.manual_seed(seed)
    mlp = LlamaMLP(config)
    for param in mlp.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return mlp.eval()


def moe_block(config, mlp, split, mean_activation) -> LlamaMoESparseMoeBlock:
    """The MoE block of `mlp` cut by `split`, with G-MoEfication compensation from `mean_activation`."""
    block = LlamaMoESparseMoeBlock(config, layer_idx=0).eval()
    tensors = build_expert_tensors(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, split)
    tensors["compensation"] = g.compensation_table(split, mlp.down_proj.weight, mean_activation)
    with torch.no_grad():
        torch.nn.init.normal_(block.gate.weight)
        torch.nn.init.zeros_(block.gate.bias)
    block.load_state_dict({**tensors, **{f"gate.{k}": v for k, v in block.gate.state_dict().items()}})
    return block


def exclude_expert(block, expert: int):
    """Make the selector score `expert` lowest for every token (the others tie higher)."""
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.selector.weight.zero_()
        block.gate.selector.bias.fill_(1.0)
        block.gate.selector.bias[expert] = -1.0


def test_compensation_adds_exactly_zero_when_every_expert_is_selected():
    config = moe_config(num_experts_per_tok=NUM_EXPERTS)
    mlp = dense_mlp(config)
    split = split_random(config.intermediate_size, NUM_EXPERTS, seed=1)
    block = moe_block(config, mlp, split, torch.randn(config.intermediate_size))
    x = torch.randn(2, 7, config.hidden_size)
    with torch.no_grad():
        with_compensation = block(x)
        block.compensation.zero_()
        without = block(x)
    assert torch.equal(with_compensation, without)
    torch.testing.assert_close(with_compensation, mlp(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("expert", [0, 3])
def test_unselected_expert_is_replaced_by_its_mean_activation(expert):
    config = moe_config(num_experts_per_tok=NUM_EXPERTS - 1)
    mlp = dense_mlp(config)
    split = split_random(config.intermediate_size, NUM_EXPERTS, seed=2)
    mean_activation = torch.randn(config.intermediate_size)
    block = moe_block(config, mlp, split, mean_activation)
    exclude_expert(block, expert)
    x = torch.randn(3, 5, config.hidden_size)

    activation = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)  # [B, S, I]
    neurons = split.expert_neurons[expert]
    activation[..., neurons] = mean_activation[neurons]
    with torch.no_grad():
        torch.testing.assert_close(block(x), mlp.down_proj(activation), rtol=1e-5, atol=1e-5)


def test_compensation_is_not_scaled_by_router_weights_or_score_scale():
    """Documented semantics: sum_{unselected} compensation_e is added as is, outside score_scale_factor."""
    config = moe_config(num_experts_per_tok=NUM_EXPERTS - 1, score_scale_factor=3.0)
    mlp = dense_mlp(config)
    split = split_random(config.intermediate_size, NUM_EXPERTS, seed=3)
    block = moe_block(config, mlp, split, torch.randn(config.intermediate_size))
    exclude_expert(block, 1)
    x = torch.randn(4, config.hidden_size)
    with torch.no_grad():
        with_compensation = block(x[None])[0]
        compensation = block.compensation[1].clone()
        block.compensation.zero_()
        torch.testing.assert_close(with_compensation - block(x[None])[0], compensation.expand_as(x))


def test_selector_router_weights_are_one_and_gradients_reach_the_selector():
    config = moe_config(moe_compensation=False, num_experts_per_tok=2)
    model = LlamaMoEForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    router = model.model.layers[0].mlp.gate
    logits, weights, index = router(torch.randn(5, config.hidden_size))
    assert logits.shape == (5, NUM_EXPERTS) and index.shape == (5, 2)
    assert torch.equal(weights, torch.ones_like(weights))
    out = model(ids, labels=ids, output_router_logits=True)
    assert out.router_logits[0].shape == (2 * 9, NUM_EXPERTS)
    out.loss.backward()
    for name in ("weight", "bias", "selector.weight", "selector.bias"):
        assert router.get_parameter(name).grad.abs().sum() > 0, name


def test_selector_and_compensation_round_trip_through_save_pretrained(tmp_path):
    config = moe_config()
    model = LlamaMoEForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.compensation.normal_()
            layer.mlp.gate.bias.normal_()
    model.save_pretrained(tmp_path)
    loaded = LlamaMoEForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.moe_compensation and loaded.config.router_type == "selector"
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids = torch.randint(0, config.vocab_size, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def selector_problem(seed=0, num_tokens=2400):
    config = moe_config()
    mlp = dense_mlp(config, seed)
    split = split_random(config.intermediate_size, NUM_EXPERTS, seed=seed)
    tensors = build_expert_tensors(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, split)
    hidden = torch.randn(num_tokens, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        mean = (F.silu(mlp.gate_proj(hidden)) * mlp.up_proj(hidden)).mean(0)
        energy = g.deviation_energy(
            hidden, tensors["experts.gate_up_proj"], tensors["experts.down_proj"], mean[split.expert_neurons]
        )
    return hidden, energy


def test_deviation_energy_is_the_same_in_its_gram_and_direct_forms(monkeypatch):
    # The Gram form (many tokens) and the direct projection (healing's few tokens of a wide layer) are one quantity,
    # with a trained compensation row as the offset.
    assert g._gram_saves(32768, 576, 192) and not g._gram_saves(512, 4096, 1792)  # SmolLM2's calibration; 8B healing
    config = moe_config()
    mlp = dense_mlp(config, 0)
    split = split_random(config.intermediate_size, NUM_EXPERTS, seed=0)
    tensors = build_expert_tensors(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, split)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(700, config.hidden_size, generator=generator)
    mean = torch.randn(NUM_EXPERTS, split.expert_neurons.shape[1], generator=generator)
    offset = torch.randn(NUM_EXPERTS, config.hidden_size, generator=generator)
    args = hidden, tensors["experts.gate_up_proj"], tensors["experts.down_proj"], mean, offset
    with torch.no_grad():
        energies = []
        for gram in (True, False):
            monkeypatch.setattr(g, "_gram_saves", lambda *shape, gram=gram: gram)
            energies.append(g.deviation_energy(*args))
    torch.testing.assert_close(energies[0], energies[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("objective, max_excess", [("listwise", 0.7), ("bce", 0.8)])
def test_selector_trains_deterministically_and_beats_a_random_router(objective, max_excess):
    hidden, energy = selector_problem()
    train, test = slice(0, 2000), slice(2000, None)
    if objective == "bce":  # the loss floor: the binary entropy of the soft labels
        labels = energy[train] / energy[train].amax(-1, keepdim=True)
        floor = F.binary_cross_entropy(labels, labels)
    else:  # scores equal to the log energies
        floor = g.selector_loss(energy[train].log(), energy[train])

    def excess_loss(state):
        return (g.selector_loss(g.selector_scores(state, hidden[train]), energy[train], objective) - floor).item()

    def fit(steps, seed=0):
        return g.train_selector(hidden[train], energy[train], NUM_EXPERTS, steps=steps, seed=seed, objective=objective)

    untrained, trained = fit(0), fit(50)
    short, again = fit(5), fit(5)
    assert all(torch.equal(short[k], again[k]) for k in short)
    assert excess_loss(trained) < max_excess * excess_loss(untrained)

    random_scores = torch.rand(energy[test].shape, generator=torch.Generator().manual_seed(1))
    for top_k in (2, NUM_EXPERTS - 1):  # ranks both ends: what to keep and what to drop
        recall = g.energy_recall(g.selector_scores(trained, hidden[test]), energy[test], top_k)
        random_recall = g.energy_recall(random_scores, energy[test], top_k)
        assert recall > random_recall + 0.05, (top_k, recall, random_recall)


def test_selector_loss_is_lowest_for_scores_ranked_like_the_energy():
    energy = torch.tensor([[4.0, 1.0, 0.25, 2.0]])
    exact = energy.log()
    assert g.selector_loss(exact + 3.0, energy) == pytest.approx(g.selector_loss(exact, energy).item())  # shift-free
    assert g.selector_loss(exact, energy) < g.selector_loss(exact.flip(-1), energy)
    assert g.selector_loss(exact, energy) < g.selector_loss(torch.zeros_like(exact), energy)


def test_listwise_loss_is_the_cross_entropy_from_both_ends():
    """The fast form (two logsumexps minus precomputed linear targets) equals the definition."""
    generator = torch.Generator().manual_seed(0)
    scores, energy = torch.randn(64, 8, generator=generator), torch.rand(64, 8, generator=generator) + 1e-3
    keep = -(F.softmax(energy.log(), -1) * F.log_softmax(scores, -1)).sum(-1)
    drop = -(F.softmax(-energy.log(), -1) * F.log_softmax(-scores, -1)).sum(-1)
    torch.testing.assert_close(g.selector_loss(scores, energy), (keep + drop).mean())


def test_train_selector_rejects_mismatched_energies_and_unknown_objectives():
    with pytest.raises(ValueError, match="energies must be"):
        g.train_selector(torch.randn(10, 8), torch.rand(10, 3), num_experts=4)
    with pytest.raises(ValueError, match="Unknown selector objective 'mse'"):
        g.train_selector(torch.randn(10, 8), torch.rand(10, 4), num_experts=4, objective="mse")


def test_oracle_routing_hooks_route_every_layer_and_are_removed():
    config = moe_config(num_experts_per_tok=2)
    model = LlamaMoEForCausalLM(config).eval()
    means = {i: torch.randn(NUM_EXPERTS, config.moe_intermediate_size) for i in config.moe_layers}
    seen = {}
    ids = torch.randint(0, config.vocab_size, (1, 8))
    with torch.no_grad(), g.oracle_routing(model, means):
        # Registered after the oracle's hooks, so these see the routing the block receives.
        handles = [
            layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, (a[0], out)))
            for i, layer in enumerate(model.model.layers)
        ]
        oracle_logits = model(ids).logits
    for handle in handles:
        handle.remove()
    assert sorted(seen) == config.moe_layers
    for i, (hidden, (_, weights, index)) in seen.items():
        experts = model.model.layers[i].mlp.experts
        expected = g.oracle_top_k(hidden, experts.gate_up_proj, experts.down_proj, means[i], 2)
        assert torch.equal(index, expected) and torch.equal(weights, torch.ones_like(weights))
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, oracle_logits)  # hooks gone: the selector routes again


def test_compensation_lowers_the_error_of_a_real_smollm2_layer(smollm2, real_text):
    """Real model, real text: with the same routing, the mean-compensated MoE layer is closer to the dense FFN."""
    model, tokenizer = smollm2
    layer = 3
    ids = tokenize_calibration(real_text[:40], tokenizer, num_tokens=512, seq_len=64)
    calibration = collect_calibration(model, ids[:6], [layer], max_hidden_samples=128).mlp[layer]
    held_out = collect_calibration(model, ids[6:8], [layer], max_hidden_samples=128).mlp[layer].hidden_states

    mlp = model.model.layers[layer].mlp
    split = split_random(mlp.gate_proj.out_features, 8, seed=0)
    compensation = g.compensation_table(split, mlp.down_proj.weight, calibration.mean_activation)
    tensors = build_expert_tensors(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, split)
    index = torch.randint(0, 8, (held_out.shape[0], 1), generator=torch.Generator().manual_seed(0))  # drop one
    with torch.no_grad():
        dense = mlp(held_out)
        activation = F.silu(mlp.gate_proj(held_out)) * mlp.up_proj(held_out)
        dropped = split.expert_neurons[index[:, 0]]  # [T, m]
        kept = activation.scatter(1, dropped, 0.0)
        without = mlp.down_proj(kept)
        with_compensation = without + compensation[index[:, 0]]
    error_with = (with_compensation - dense).norm()
    error_without = (without - dense).norm()
    assert error_with < error_without, (error_with, error_without)  # the mean is the best constant stand-in
    # deviation_energy (what the oracle and the selector rank) is exactly that per-token squared error.
    energy = g.deviation_energy(
        held_out,
        tensors["experts.gate_up_proj"],
        tensors["experts.down_proj"],
        calibration.mean_activation[split.expert_neurons],
    )
    squared_error = (with_compensation - dense).square().sum(-1)
    torch.testing.assert_close(energy.gather(1, index)[:, 0], squared_error, rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Through the command line, on real files
# ----------------------------------------------------------------------------------------------------------------


def test_cli_compensation_and_selector_keep_the_dense_identity_with_every_expert_on(
    tiny_dense, tiny_calibration, tmp_path
):
    """`--compensation --router-init selector`: selector router with unit weights, score scale 1, so with top-k = N
    the converted model is exactly the dense model (the compensation adds exactly zero)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from llama_moe.commands import main

    dense_path, input_ids, reference = tiny_dense
    common = [
        "--model",
        str(dense_path),
        "--method",
        "random",
        "--num-experts",
        "4",
        "--compensation",
        "--router-init",
        "selector",
        "--selector-steps",
        "20",
        "--calibration-data",
        str(tiny_calibration),
        "--calibration-tokens",
        "256",
        "--calibration-seq-len",
        "32",
        "--no-progress",
    ]
    assert main(["convert", "--output", str(tmp_path / "all"), "--top-k", "4", *common]) == 0
    config = AutoConfig.from_pretrained(tmp_path / "all")
    assert (config.router_type, config.moe_compensation, config.score_scale_factor) == ("selector", True, 1.0)
    weights = load_file(tmp_path / "all" / "model.safetensors")
    assert weights["model.layers.0.mlp.compensation"].shape == (4, 64)
    assert weights["model.layers.0.mlp.compensation"].abs().sum() > 0
    assert weights["model.layers.1.mlp.gate.selector.weight"].shape == (4, 4)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "all", dtype=torch.float32).eval()
        torch.testing.assert_close(model(input_ids).logits, reference, atol=1e-4, rtol=0)

    assert main(["convert", "--output", str(tmp_path / "bad"), "--router-type", "switch", *common]) == 2


def test_compensation_alone_calibrates_its_mean_activations(tiny_dense, tiny_calibration, tmp_path):
    """A random split with compensation: no method or router asks for statistics, the compensation table does."""
    from safetensors.torch import load_file

    from llama_moe_hf import convert_to_moe

    result = convert_to_moe(tiny_dense[0], tmp_path / "moe", method="random", num_experts=4, compensation=True,
                            calibration_data=str(tiny_calibration), calibration_tokens=256, calibration_seq_len=32,
                            progress=False)  # fmt: skip
    assert load_file(result.output_dir / "model.safetensors")["model.layers.1.mlp.compensation"].abs().sum() > 0
    info = json.loads((result.output_dir / "config.json").read_text())["conversion_info"]
    assert info["calibration_data"].startswith("local file")


def test_a_linear_router_fitted_like_the_selector_ranks_better_than_random_and_loads_as_top_k():
    """`router_type="top_k"`: the selector's objective with linear logits, the state dict of the model's own top_k
    router (the `linear_selector` init, which every export target computes)."""
    hidden, energy = selector_problem()
    train, test = slice(0, 2000), slice(2000, None)
    state = g.train_selector(hidden[train], energy[train], NUM_EXPERTS, steps=50, router_type="top_k")
    assert set(state) == {"weight"} and state["weight"].shape == (NUM_EXPERTS, hidden.shape[1])
    scores = g.selector_scores(state, hidden[test], router_type="top_k")
    torch.testing.assert_close(scores, hidden[test] @ state["weight"].T)  # linear logits, nothing else
    random_scores = torch.rand(energy[test].shape, generator=torch.Generator().manual_seed(1))
    for top_k in (1, 2):
        recall = g.energy_recall(scores, energy[test], top_k)
        assert recall > g.energy_recall(random_scores, energy[test], top_k) + 0.05, (top_k, recall)


def test_the_even_weight_temperature_reproduces_unit_weights():
    """k times the renormalised top-k weights should give each chosen expert weight 1: with every expert chosen that
    is exact as the temperature goes to 0, so the smallest wins; at top-1 the weight is 1 whatever the temperature."""
    from llama_moe.conversion.routers.linear_selector import TEMPERATURES, even_weight_temperature

    config = moe_config()
    mlp = dense_mlp(config)
    split = split_random(config.intermediate_size, NUM_EXPERTS, seed=0)
    tensors = build_expert_tensors(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, split)
    hidden = torch.randn(256, config.hidden_size, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(NUM_EXPERTS, config.hidden_size, generator=torch.Generator().manual_seed(1))
    assert even_weight_temperature(hidden, tensors, weight, NUM_EXPERTS) == min(TEMPERATURES)
    assert even_weight_temperature(hidden, tensors, weight, 1) == 1.0
    # with logits that already weight the chosen experts unequally on purpose, a larger temperature can win
    assert even_weight_temperature(hidden, tensors, weight * 1e-3, 2) in TEMPERATURES

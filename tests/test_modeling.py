"""LlamaMoE modeling: config validation, exact dense identities, routers, generation, expert implementations,
auxiliary losses and the checkpoint format.

Models are built in memory: tiny random GQA configs, and the real SmolLM2-135M-Instruct split into experts with
`build_expert_tensors` (`moe_from_dense`, also used by test_training.py).
"""

import json

import pytest
import torch
from conftest import tiny_llama, tiny_llama_config
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.initialization import no_init_weights
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from llama_moe_hf import LlamaMoEConfig, LlamaMoEForCausalLM
from llama_moe_hf.conversion.convert import dense_config_fields
from llama_moe_hf.conversion.experts import ExpertSplit, build_expert_tensors, split_random, split_upcycle
from llama_moe_hf.modeling.modeling_llama_moe import LlamaMoERouter, router_z_loss_func


def moe_config_from_dense(dense_config, **moe_fields) -> LlamaMoEConfig:
    return LlamaMoEConfig(**dense_config_fields(dense_config), **moe_fields)


def moe_from_dense(dense_model, split: ExpertSplit, router_std: float = 0.0, **moe_fields) -> LlamaMoEForCausalLM:
    """The dense model with the FFN of every layer in `moe_layers` cut into `split`; router ~ N(0, router_std)."""
    config = moe_config_from_dense(
        dense_model.config,
        num_experts=split.num_experts,
        moe_intermediate_size=split.expert_size,
        num_shared_experts=0 if split.shared_neurons is None else split.shared_neurons.numel() // split.expert_size,
        **moe_fields,
    )
    state_dict = dict(dense_model.state_dict())
    for layer_idx in config.moe_layers:
        prefix = f"model.layers.{layer_idx}.mlp."
        dense = [state_dict.pop(prefix + f"{name}.weight") for name in ("gate_proj", "up_proj", "down_proj")]
        for name, tensor in build_expert_tensors(*dense, split).items():
            state_dict[prefix + name] = tensor
        state_dict[prefix + "gate.weight"] = torch.randn(split.num_experts, config.hidden_size) * router_std
        if config.router_type == "noisy_top_k":
            state_dict[prefix + "gate.noise_weight"] = torch.zeros(split.num_experts, config.hidden_size)
    with no_init_weights():  # every weight comes from the state dict
        model = LlamaMoEForCausalLM(config)
    model.load_state_dict(state_dict, strict=True)
    model.tie_weights()
    return model.eval()


def tiny_moe(**moe_fields) -> LlamaMoEForCausalLM:
    """A tiny random LlamaMoE (GQA, 2 layers, 4 experts of 24, top-2 by default)."""
    torch.manual_seed(0)
    fields = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24} | moe_fields
    return LlamaMoEForCausalLM(moe_config_from_dense(tiny_llama_config(), **fields)).eval()


def token_batch(batch_size=2, length=12, vocab_size=128, seed=0):
    return torch.randint(3, vocab_size, (batch_size, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def smollm2_moe_top2(smollm2):
    """SmolLM2 split into 8 random experts per layer, top-2 with a random router (a real sparse model)."""
    dense, _ = smollm2
    torch.manual_seed(0)
    # Every third layer is MoE: keeps generation fast while the dense layers in between are exercised too.
    return moe_from_dense(
        dense, split_random(1536, 8), router_std=0.05, num_experts_per_tok=2, moe_layers=list(range(0, 30, 3))
    )


# ----------------------------------------------------------------------------------------------------------------
# Config validation


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_experts": 4, "num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"num_experts": 0, "moe_intermediate_size": 8}, "num_experts must be at least 1"),
        ({"router_type": "expert_choice"}, "Unknown router_type 'expert_choice'"),
        ({"score_scale_factor": [1.0, 2.0, 3.0]}, "score_scale_factor has 3 values"),
        ({"moe_layers": [0, 2]}, r"moe_layers \[2\] are outside"),
        ({"moe_layers": [-1]}, r"moe_layers \[-1\] are outside"),
        ({"moe_layers": [1, 1]}, "moe_layers has duplicates"),
    ],
)
def test_config_rejects_bad_moe_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        moe_config_from_dense(tiny_llama_config(), **fields)


def test_config_defaults_split_the_dense_ffn_evenly():
    config = moe_config_from_dense(tiny_llama_config(), num_experts=4, num_shared_experts=1)
    assert config.model_type == "llama_moe"
    assert config.moe_intermediate_size == 96 // 4
    assert config.shared_expert_intermediate_size == config.moe_intermediate_size
    assert config.moe_layers == [0, 1]


# ----------------------------------------------------------------------------------------------------------------
# Exact identities with the dense model


@torch.no_grad()
def assert_same_logits(moe, dense, input_ids, atol=1e-4):
    expected = dense(input_ids).logits
    actual = moe(input_ids).logits
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("num_shared_experts", [0, 2])
def test_all_experts_on_with_unit_weights_is_the_dense_model_tiny(num_shared_experts):
    dense = tiny_llama()
    split = split_random(96, 4, num_shared_experts=num_shared_experts, seed=1)
    moe = moe_from_dense(dense, split, num_experts_per_tok=4, score_scale_factor=4.0)
    assert_same_logits(moe, dense, token_batch())


@pytest.mark.slow
def test_all_experts_on_with_unit_weights_is_the_dense_model_smollm2(smollm2, real_text):
    """8 routed + 4 shared experts of 128 neurons in all 30 layers (the tiny test covers no shared experts too)."""
    dense, tokenizer = smollm2
    split = split_random(1536, 8, num_shared_experts=4, seed=0)
    moe = moe_from_dense(dense, split, num_experts_per_tok=8, score_scale_factor=8.0)
    assert len(moe.config.moe_layers) == 30 and moe.config.num_key_value_heads == 3
    input_ids = tokenizer(real_text[0][:200], return_tensors="pt").input_ids
    assert_same_logits(moe, dense, input_ids)


def test_the_identity_test_can_fail():
    """Guards the test above: a single expert off breaks the identity."""
    dense = tiny_llama()
    moe = moe_from_dense(dense, split_random(96, 4), num_experts_per_tok=3, score_scale_factor=4.0)
    with pytest.raises(AssertionError):
        assert_same_logits(moe, dense, token_batch())


def test_upcycled_model_equals_dense_for_any_router():
    dense = tiny_llama()
    for router_type in ("top_k", "noisy_top_k"):
        moe = moe_from_dense(dense, split_upcycle(96, 4), router_std=1.0, router_type=router_type)
        assert_same_logits(moe, dense, token_batch())


def test_moe_layers_subset_keeps_dense_mlps_elsewhere():
    dense = tiny_llama(num_hidden_layers=3)
    moe = moe_from_dense(dense, split_random(96, 4), num_experts_per_tok=4, score_scale_factor=4.0, moe_layers=[1])
    keys = moe.state_dict().keys()
    assert "model.layers.0.mlp.gate_proj.weight" in keys and "model.layers.2.mlp.down_proj.weight" in keys
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and "model.layers.1.mlp.gate_proj.weight" not in keys
    assert_same_logits(moe, dense, token_batch())


def test_per_layer_score_scale_factor():
    dense = tiny_llama()
    split = split_random(96, 4)
    moe = moe_from_dense(dense, split, num_experts_per_tok=4, score_scale_factor=[4.0, 4.0])
    assert_same_logits(moe, dense, token_batch())
    moe = moe_from_dense(dense, split, num_experts_per_tok=4, score_scale_factor=[4.0, 2.0])
    assert [layer.mlp.score_scale_factor for layer in moe.model.layers] == [4.0, 2.0]
    with pytest.raises(AssertionError):
        assert_same_logits(moe, dense, token_batch())


# ----------------------------------------------------------------------------------------------------------------
# Routers


def router(router_type, top_k=2, num_experts=6):
    config = moe_config_from_dense(tiny_llama_config(), num_experts=num_experts, num_experts_per_tok=top_k)
    config.router_type = router_type
    torch.manual_seed(0)
    module = LlamaMoERouter(config)
    torch.nn.init.normal_(module.weight, std=0.5)
    if router_type == "noisy_top_k":
        torch.nn.init.normal_(module.noise_weight, std=0.5)
    return module


def test_top_k_router_weights_sum_to_one():
    logits, weights, index = router("top_k")(torch.randn(10, 64))
    assert logits.shape == (10, 6) and weights.shape == index.shape == (10, 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))
    assert torch.equal(index, logits.topk(2, dim=-1).indices)


def test_switch_router_keeps_the_softmax_probability():
    logits, weights, index = router("switch", top_k=1)(torch.randn(10, 64))
    torch.testing.assert_close(weights, logits.softmax(-1).gather(1, index))
    assert (weights < 1).all()


def test_noisy_top_k_router_is_deterministic_in_eval_and_noisy_in_training():
    noisy, plain = router("noisy_top_k"), router("top_k")
    plain.weight.data.copy_(noisy.weight.data)
    states = torch.randn(50, 64)
    noisy.eval()
    for expected, actual in zip(plain(states), noisy(states)):
        assert torch.equal(expected, actual)

    noisy.train()
    first, second = noisy(states)[0], noisy(states)[0]
    assert not torch.allclose(first, second)
    first.square().sum().backward()
    assert noisy.noise_weight.grad is not None and noisy.noise_weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------
# Generation, attention and expert implementations


def test_greedy_generation_with_cache_equals_without():
    model = tiny_moe()
    input_ids = token_batch(batch_size=1, length=6)
    kwargs = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    cached = model.generate(input_ids, past_key_values=DynamicCache(config=model.config), **kwargs)
    uncached = model.generate(input_ids, use_cache=False, **kwargs)
    assert cached.shape == (1, 16)
    assert torch.equal(cached, uncached)


@pytest.mark.slow
def test_batched_left_padded_generation_equals_one_by_one(smollm2, smollm2_moe_top2):
    _, tokenizer = smollm2
    model = smollm2_moe_top2
    prompts = ["The capital of France is", "Python is a programming language that lets you"]
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    assert (batch.attention_mask == 0).any()
    batched = model.generate(**batch, **kwargs)[:, batch.input_ids.shape[1] :]
    for row, prompt in enumerate(prompts):
        single = tokenizer(prompt, return_tensors="pt")
        alone = model.generate(**single, **kwargs)[0, single.input_ids.shape[1] :]
        assert torch.equal(batched[row], alone), prompt


@torch.no_grad()
def test_eager_attention_equals_sdpa():
    model = tiny_moe()
    input_ids = token_batch()
    model.set_attn_implementation("sdpa")
    sdpa = model(input_ids).logits
    model.set_attn_implementation("eager")
    torch.testing.assert_close(model(input_ids).logits, sdpa, atol=1e-5, rtol=1e-4)


def test_default_experts_implementation_is_ours(tmp_path):
    model = tiny_moe()
    assert model.config._experts_implementation == "eager"
    model.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._experts_implementation == "eager"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="grouped_mm")
    assert loaded.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("num_shared_experts", [0, 1])
def test_transformers_experts_implementations_match_ours(implementation, num_shared_experts):
    """Same logits and same gradients (through the router weights too) as our eager expert loop."""
    model = tiny_moe(num_experts=6, num_experts_per_tok=2, num_shared_experts=num_shared_experts).train()
    input_ids = token_batch(batch_size=3, length=9)

    def logits_and_grads():
        model.zero_grad()
        logits = model(input_ids).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if "mlp" in name}

    expected_logits, expected_grads = logits_and_grads()
    assert expected_grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    model.set_experts_implementation(implementation)
    assert model.config._experts_implementation == implementation
    logits, grads = logits_and_grads()
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-4)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "num_tokens, used_experts",
    [(1, 4), (2, 4), (3, 4), (33, 4), (200, 4), (40, 2), (300, 4), (129, 2)],
)
def test_every_expert_path_matches_grouped_mm(num_tokens, used_experts):
    """4 experts, top-2: up to 2 tokens take the per-pair (decoding) path; while no expert gets more than
    BMM_MAX_ROWS_PER_EXPERT = 128 rows, the padded batched matmul (also with experts that get no token); beyond, the
    per-expert loop. Each must equal transformers' grouped_mm implementation, gradients included."""
    model = tiny_moe()
    experts = model.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(num_tokens)
    states = torch.randn(num_tokens, 64, generator=generator)
    index = torch.stack([torch.randperm(used_experts, generator=generator)[:2] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, 2, generator=generator)

    def run(implementation):
        model.set_experts_implementation(implementation)
        inputs = [states.clone().requires_grad_(), weights.clone().requires_grad_()]
        experts.zero_grad()
        output = experts(inputs[0], index, inputs[1])
        (output * torch.linspace(-1, 1, 64)).sum().backward()
        return [output, *(t.grad for t in inputs), experts.gate_up_proj.grad, experts.down_proj.grad]

    for expected, actual in zip(run("grouped_mm"), run("eager")):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_bf16_forward():
    model = tiny_moe()
    input_ids = token_batch()
    reference = model(input_ids).logits
    logits = model.to(torch.bfloat16)(input_ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    torch.testing.assert_close(logits.float(), reference, atol=0.05, rtol=0.05)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_moe(num_shared_experts=1, output_router_logits=True, router_z_loss_coef=0.01).train()
    input_ids = token_batch()

    def grads():
        model.zero_grad()
        model(input_ids, labels=input_ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    expected = grads()
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing
    actual = grads()
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, atol=1e-6, rtol=1e-4, msg=name)


# ----------------------------------------------------------------------------------------------------------------
# Router outputs and auxiliary losses


def test_router_logits_and_loss_composition():
    model = tiny_moe(num_experts=5, moe_layers=[1], router_aux_loss_coef=0.02, router_z_loss_coef=0.3)
    input_ids = token_batch(batch_size=2, length=7)
    plain = model(input_ids, labels=input_ids)
    assert plain.aux_loss is None and not plain.router_logits

    out = model(input_ids, labels=input_ids, output_router_logits=True)
    assert len(out.router_logits) == 1  # one MoE layer
    assert out.router_logits[0].shape == (14, 5)
    expected_aux = load_balancing_loss_func(out.router_logits, 5, 2)
    torch.testing.assert_close(out.aux_loss, expected_aux)
    z_loss = router_z_loss_func(out.router_logits)
    torch.testing.assert_close(out.loss, plain.loss + 0.02 * out.aux_loss + 0.3 * z_loss)


def test_aux_loss_alone_trains_the_router():
    """The load-balancing loss must have a gradient (LLaMA-MoE-v2's copy of the old loss had none)."""
    model = tiny_moe(output_router_logits=True)
    model(token_batch()).aux_loss.backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
    # Only routing probabilities enter the loss: the last layer's experts feed no router.
    assert model.model.layers[-1].mlp.experts.down_proj.grad is None


def test_z_loss_is_positive_and_differentiable():
    model = tiny_moe()
    out = model(token_batch(), output_router_logits=True)
    z_loss = router_z_loss_func(out.router_logits)
    assert z_loss > 0
    z_loss.backward()
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


@torch.no_grad()
def test_aux_loss_ignores_padding():
    model = tiny_moe(output_router_logits=True)
    input_ids = token_batch(batch_size=1, length=8)
    padded = torch.cat([input_ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)  # right padding keeps positions
    mask = torch.cat([torch.ones(1, 8), torch.zeros(1, 5)], dim=1).long()
    alone = model(input_ids).aux_loss
    torch.testing.assert_close(model(padded, attention_mask=mask).aux_loss, alone)
    assert not torch.allclose(model(padded, attention_mask=torch.ones_like(mask)).aux_loss, alone)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint format


def test_save_and_load_round_trip(tmp_path):
    dense = tiny_llama(num_hidden_layers=3)
    moe = moe_from_dense(
        dense,
        split_random(96, 3, num_shared_experts=1),
        router_std=0.5,
        num_experts_per_tok=2,
        moe_layers=[0, 2],
        score_scale_factor=[2.0, 1.0, 3.0],
        router_type="switch",
        router_aux_loss_coef=0.05,
        conversion_info={"method": "random", "seed": 0},
    )
    moe.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors", "configuration_llama_moe.py", "modeling_llama_moe.py"} <= {
        path.name for path in tmp_path.iterdir()
    }
    saved_config = json.loads((tmp_path / "config.json").read_text())
    assert saved_config["model_type"] == "llama_moe"
    assert saved_config["auto_map"]["AutoModelForCausalLM"] == "modeling_llama_moe.LlamaMoEForCausalLM"

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj").shape == (3, 2 * 24, 64)
        assert f.get_tensor("model.layers.2.mlp.experts.down_proj").shape == (3, 64, 24)
    expected_moe = {"gate.weight", "experts.gate_up_proj", "experts.down_proj"} | {
        f"shared_experts.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")
    }
    dense_mlp = {f"{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")}
    for layer_idx, expected in [(0, expected_moe), (1, dense_mlp), (2, expected_moe)]:
        prefix = f"model.layers.{layer_idx}.mlp."
        assert {key[len(prefix) :] for key in keys if key.startswith(prefix)} == expected
    assert not [key for key in keys if "weight_g" in key or "weight_v" in key]
    assert not [name for name, _ in moe.named_parameters() if "weight_g" in name or "weight_v" in name]

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LlamaMoEForCausalLM
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_shared_experts",
                  "score_scale_factor", "router_type", "router_aux_loss_coef", "moe_layers", "conversion_info",
                  "num_key_value_heads"):  # fmt: skip
        assert getattr(loaded.config, field) == getattr(moe.config, field), field
    for name, tensor in moe.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    input_ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, moe(input_ids).logits, atol=0, rtol=0)

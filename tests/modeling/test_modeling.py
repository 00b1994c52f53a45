"""LlamaMoE modeling: config validation, exact dense identities, routers, expert implementations, generation with
dynamic and static caches and torch.compile, classification heads, parallel plans, router losses, checkpoint format.

MoE models are built in memory from tiny random GQA models and from the real SmolLM2-135M-Instruct with `build_moe`,
the converter's own in-memory path.
"""

import copy
import json
import warnings

import pytest
import torch
from helpers import assert_same_logits, tiny_family_model, tiny_llama, tiny_llama_config, tiny_moe, token_batch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from llama_moe.conversion.settings import ATTENTION_GRANULARITIES, ROUTER_TYPES, ROUTING_MODES
from llama_moe.source_families import dense_config_fields
from llama_moe_hf import LlamaMoEConfig, LlamaMoEForCausalLM, build_moe
from llama_moe_hf.modeling import (
    configuration_attn_moe,
    configuration_soap_moe,
    moe_kernels,
)
from llama_moe_hf.modeling.cache_compat import CACHE_ARG
from llama_moe_hf.modeling.moe_kernels import indexed_reduction_experts_forward
from llama_moe_hf.modeling.router_losses import router_z_loss_func
from llama_moe_hf.modeling.routers import ROUTER_CLASSES, LlamaMoERouter


@pytest.fixture(scope="module")
def smollm2_moe_top2(smollm2):
    """SmolLM2 split into 8 random experts in every third layer (dense MLPs in between), top-2, random router."""
    dense, _ = smollm2
    moe = build_moe(dense, method="random", num_experts=8, top_k=2, moe_layers=["every:3"])
    for layer in moe.config.moe_layers:
        moe.model.layers[layer].mlp.gate.weight.data.mul_(2.5)  # std 0.05: routing that varies between tokens
    return moe


# ----------------------------------------------------------------------------------------------------------------
# Config validation


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_experts": 4, "num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"num_experts": 0, "moe_intermediate_size": 8}, "num_experts must be at least 1"),
        ({"router_type": "expert-choice"}, "Unknown router_type 'expert-choice'"),
        ({"score_scale_factor": [1.0, 2.0, 3.0]}, "score_scale_factor has 3 values"),
        ({"moe_layers": [0, 2]}, r"moe_layers \[2\] are outside"),
        ({"moe_layers": [-1]}, r"moe_layers \[-1\] are outside"),
        ({"moe_layers": [1, 1]}, "moe_layers has duplicates"),
    ],
)
def test_config_rejects_bad_moe_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        LlamaMoEConfig(**dense_config_fields(tiny_llama_config()), **fields)


def test_config_defaults_split_the_dense_ffn_evenly():
    config = LlamaMoEConfig(**dense_config_fields(tiny_llama_config()), num_experts=4, num_shared_experts=1)
    assert config.model_type == "llama_moe"
    assert config.moe_intermediate_size == 96 // 4
    assert config.shared_expert_intermediate_size == config.moe_intermediate_size
    assert config.moe_layers == [0, 1]


def test_names_agree_between_the_config_the_model_and_the_command_line():
    assert tuple(ROUTER_CLASSES) == ROUTER_TYPES
    assert configuration_attn_moe.ATTENTION_EXPERT_GRANULARITIES == ATTENTION_GRANULARITIES
    assert configuration_soap_moe.ROUTING_MODES == ROUTING_MODES


# ----------------------------------------------------------------------------------------------------------------
# Exact identities with the dense model


@pytest.mark.parametrize("num_shared_experts", [0, 2])
def test_all_experts_on_with_unit_weights_is_the_dense_model_tiny(num_shared_experts):
    dense = tiny_llama()
    moe = build_moe(
        dense,
        num_experts=4,
        top_k=4,
        num_shared_experts=num_shared_experts,
        router_init="zero",
        score_scale_factor=4.0,
        seed=1,
    )
    assert_same_logits(moe, dense, token_batch())


@pytest.mark.slow
def test_all_experts_on_with_unit_weights_is_the_dense_model_smollm2(smollm2, real_text):
    """8 routed + 4 shared experts of 128 neurons in all 30 layers (the tiny test covers no shared experts too)."""
    dense, tokenizer = smollm2
    moe = build_moe(dense, num_experts=8, top_k=8, num_shared_experts=4, router_init="zero", score_scale_factor=8.0)
    assert len(moe.config.moe_layers) == 30 and moe.config.num_key_value_heads == 3
    input_ids = tokenizer(real_text[0][:200], return_tensors="pt").input_ids
    assert_same_logits(moe, dense, input_ids)


def test_the_identity_test_can_fail():
    """Guards the test above: a single expert off breaks the identity."""
    dense = tiny_llama()
    moe = build_moe(dense, num_experts=4, top_k=3, router_init="zero", score_scale_factor=4.0)
    with pytest.raises(AssertionError):
        assert_same_logits(moe, dense, token_batch())


@pytest.mark.parametrize("router_type", ["top_k", "switch", "noisy_top_k"])
def test_upcycled_model_equals_dense_for_any_router(router_type):
    dense = tiny_llama()
    moe = build_moe(dense, method="upcycle", num_experts=4, router_type=router_type)
    for layer in moe.model.layers:
        layer.mlp.gate.weight.data.normal_(std=1.0)
    if router_type == "switch":  # unnormalised top-k weights: the dense output times the kept probability mass
        with pytest.raises(AssertionError):
            assert_same_logits(moe, dense, token_batch())
        return
    assert_same_logits(moe, dense, token_batch())


def test_moe_layers_subset_keeps_dense_mlps_elsewhere():
    dense = tiny_llama(num_hidden_layers=3)
    moe = build_moe(dense, num_experts=4, top_k=4, router_init="zero", score_scale_factor=4.0, moe_layers=["1"])
    keys = moe.state_dict().keys()
    assert "model.layers.0.mlp.gate_proj.weight" in keys and "model.layers.2.mlp.down_proj.weight" in keys
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and "model.layers.1.mlp.gate_proj.weight" not in keys
    assert_same_logits(moe, dense, token_batch())


def test_per_layer_score_scale_factor():
    dense = tiny_llama()
    moe = build_moe(dense, num_experts=4, top_k=4, router_init="zero", score_scale_factor=4.0)
    moe.config.score_scale_factor = [4.0, 2.0]
    rebuilt = LlamaMoEForCausalLM(moe.config).eval()
    rebuilt.load_state_dict(moe.state_dict())
    assert [layer.mlp.score_scale_factor for layer in rebuilt.model.layers] == [4.0, 2.0]
    with pytest.raises(AssertionError):
        assert_same_logits(rebuilt, dense, token_batch())
    moe.config.score_scale_factor = [4.0, 4.0]
    rebuilt = LlamaMoEForCausalLM(moe.config).eval()
    rebuilt.load_state_dict(moe.state_dict())
    assert_same_logits(rebuilt, dense, token_batch())


# ----------------------------------------------------------------------------------------------------------------
# Routers: one class per gate


def router(router_type, top_k=2, num_experts=6) -> LlamaMoERouter:
    config = LlamaMoEConfig(
        **dense_config_fields(tiny_llama_config()),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        router_type=router_type,
    )
    torch.manual_seed(0)
    module = ROUTER_CLASSES[router_type](config)
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.5)
    return module


def test_each_gate_is_its_own_router_class():
    model = tiny_moe(router_type="switch")
    assert type(model.model.layers[0].mlp.gate).__name__ == "LlamaMoESwitchRouter"
    assert all(issubclass(cls, LlamaMoERouter) for cls in ROUTER_CLASSES.values())


def test_a_new_gate_is_one_class():
    class HalfTopKRouter(LlamaMoERouter):  # defined elsewhere than routers.py, as a plugin would
        router_type = "test_half_top_k"

    try:
        assert ROUTER_CLASSES["test_half_top_k"] is HalfTopKRouter
        config = LlamaMoEConfig(**dense_config_fields(tiny_llama_config()), router_type="test_half_top_k")
        assert config.router_type == "test_half_top_k"
    finally:
        ROUTER_CLASSES.pop("test_half_top_k")
    with pytest.raises(ValueError, match="Unknown router_type 'test_half_top_k'"):
        LlamaMoEConfig(**dense_config_fields(tiny_llama_config()), router_type="test_half_top_k")


def test_top_k_router_is_mixtrals_renormalised_softmax():
    logits, weights, index = router("top_k")(torch.randn(10, 64))
    assert logits.shape == (10, 6) and weights.shape == index.shape == (10, 2)
    probs = logits.softmax(-1)
    expected_weights, expected_index = probs.topk(2, dim=-1)
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(weights, expected_weights / expected_weights.sum(-1, keepdim=True))


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


def test_selector_router_gives_unit_weights_with_a_straight_through_gradient():
    selector = router("selector", top_k=3)
    logits, weights, index = selector(torch.randn(10, 64))
    assert torch.equal(weights, torch.ones(10, 3)) and torch.equal(index, logits.topk(3, dim=-1).indices)
    weights.sum().backward()
    assert selector.weight.grad.abs().sum() > 0 and selector.selector.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------
# Expert implementations


def test_default_experts_implementation_is_chosen_per_device(tmp_path):
    model = tiny_moe()
    assert model.config._experts_implementation == "llama_moe_auto"
    model.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._experts_implementation == "llama_moe_auto"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="grouped_mm")
    assert loaded.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("implementation", ["llama_moe_auto", "llama_moe_cpu", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("num_shared_experts", [0, 1])
def test_experts_implementations_match_the_eager_reference(implementation, num_shared_experts):
    """Same logits and same gradients (through the router weights too) as the plain reference loop."""
    model = tiny_moe(num_experts=6, num_experts_per_tok=2, num_shared_experts=num_shared_experts).train()
    input_ids = token_batch(batch_size=3, length=9)

    def logits_and_grads():
        model.zero_grad()
        logits = model(input_ids).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if "mlp" in name}

    model.set_experts_implementation("eager")
    expected_logits, expected_grads = logits_and_grads()
    assert expected_grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    model.set_experts_implementation(implementation)
    logits, grads = logits_and_grads()
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-4)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "num_tokens, used_experts",
    [(1, 4), (2, 4), (3, 4), (33, 4), (200, 4), (40, 2), (300, 4), (129, 2)],
)
def test_every_branch_of_the_cpu_dispatch_matches_grouped_mm(num_tokens, used_experts):
    """4 experts, top-2: up to 2 tokens take the matrix-vector (decoding) branch; while no expert gets more than
    BMM_MAX_ROWS_PER_EXPERT = 128 rows (4 x 128 padded rows stay within BMM_MAX_PADDED_ROWS), the padded batched
    matmul (also with experts that get no token); beyond, the per-expert loop. Each must equal transformers'
    grouped_mm implementation, gradients included."""
    model = tiny_moe()
    experts = model.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(num_tokens)
    states = torch.randn(num_tokens, 64, generator=generator)
    index = torch.stack([torch.randperm(used_experts, generator=generator)[:2] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, 2, generator=generator)

    def run(implementation, function=None):
        model.set_experts_implementation(implementation)
        inputs = [states.clone().requires_grad_(), weights.clone().requires_grad_()]
        experts.zero_grad()
        output = function(experts, inputs[0], index, inputs[1]) if function else experts(inputs[0], index, inputs[1])
        (output * torch.linspace(-1, 1, 64)).sum().backward()
        return [output, *(t.grad for t in inputs), experts.gate_up_proj.grad, experts.down_proj.grad]

    expected = run("grouped_mm")
    for actual, reference in zip(run("llama_moe_cpu"), expected):
        torch.testing.assert_close(actual, reference, atol=1e-6, rtol=1e-5)
    if index.numel() <= experts.num_experts:  # the compiled decoding path (llama_moe_auto), run eagerly here
        for actual, reference in zip(run("eager", indexed_reduction_experts_forward), expected):
            torch.testing.assert_close(actual, reference, atol=1e-6, rtol=1e-5)


@pytest.mark.smoke
@torch.no_grad()
def test_the_compiled_cpu_decoding_kernel_decodes_as_llama_moe_cpu(monkeypatch):
    """`llama_moe_cpu_compiled` runs its inductor kernels (routed and shared experts) for every decoding step of every
    layer, with one graph each for them all (a second generation compiles nothing), and gives llama_moe_cpu's greedy
    tokens and logits."""
    model = tiny_moe(num_shared_experts=1)  # 2 MoE layers
    input_ids = token_batch(batch_size=1, length=6)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    model.set_experts_implementation("llama_moe_cpu")
    expected = model.generate(input_ids, **kwargs)
    cache = DynamicCache(config=model.config)
    model(input_ids, cache=cache, use_cache=True)
    expected_step = model(expected[:, 6:7], cache=copy.deepcopy(cache), use_cache=True).logits
    calls, compiled = [], moe_kernels.compiled  # the routed experts' kernel and the shared ones', by name
    counted = lambda kernel: lambda *a: calls.append(kernel.__name__) or compiled(kernel)(*a)  # noqa: E731
    monkeypatch.setattr(moe_kernels, "compiled", counted)
    model.set_experts_implementation("llama_moe_cpu_compiled")
    monkeypatch.setattr(moe_kernels, "_COMPILE_FAILED", [])  # where a failed compile says why
    assert torch.equal(model.generate(input_ids, **kwargs), expected)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(input_ids, **kwargs), expected)
    step = model(expected[:, 6:7], cache=cache, use_cache=True).logits
    assert not moe_kernels._COMPILE_FAILED
    steps = 2 * (2 * 7 + 1)  # two generations of 7 decoding steps, and one step, in 2 layers
    assert calls.count("silu_indexed_reduction") == calls.count("silu_mlp_reduction") == steps
    torch.testing.assert_close(step, expected_step, atol=1e-5, rtol=1e-4)


def test_the_compiled_cpu_decoding_kernel_is_left_out_where_it_does_not_apply_or_cannot_compile(monkeypatch):
    """With autograd, more (token, expert) pairs than experts, another activation or wrapped shared projections,
    llama_moe_cpu runs; past Dynamo's recompile limit too, for that call; where compiling fails, a warning once, and
    llama_moe_cpu from then on."""
    model = tiny_moe(num_shared_experts=1)
    model.set_experts_implementation("llama_moe_cpu_compiled")
    experts, shared = model.model.layers[0].mlp.experts, model.model.layers[0].mlp.shared_experts  # 4 experts, top-2
    forward, cpu = (
        moe_kernels.llama_moe_cpu_compiled_experts_forward,
        moe_kernels.llama_moe_cpu_experts_forward,
    )
    one = torch.randn(1, 64), torch.tensor([[0, 3]]), torch.tensor([[0.7, 0.3]])
    three = torch.randn(3, 64), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2)
    failure = [RuntimeError("no C++ compiler")]

    def kernel(*_):
        raise failure[0]

    monkeypatch.setattr(moe_kernels, "compiled", lambda _: kernel)
    monkeypatch.setattr(moe_kernels, "_COMPILE_FAILED", [])
    torch.testing.assert_close(forward(experts, *one), cpu(experts, *one))  # autograd on: not tried
    with torch.no_grad():
        torch.testing.assert_close(forward(experts, *three), cpu(experts, *three))  # 6 pairs > 4 experts
        experts.act_fn = torch.nn.GELU()
        forward(experts, *one)
        experts.act_fn = torch.nn.SiLU()
        adapted = type("Adapted", (torch.nn.Linear,), {})(64, shared.gate_proj.out_features, bias=False)
        shared.gate_proj, plain = adapted, shared.gate_proj
        shared(one[0])  # a wrapped projection (an adapter's): its weights are not all in `.weight`
        shared.gate_proj = plain
        failure[0] = torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit")
        torch.testing.assert_close(forward(experts, *one), cpu(experts, *one))
        assert not moe_kernels._COMPILE_FAILED
        failure[0] = RuntimeError("no C++ compiler")
        with pytest.warns(UserWarning, match="could not compile its decoding kernel.*no C\\+\\+ compiler"):
            torch.testing.assert_close(forward(experts, *one), cpu(experts, *one))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.testing.assert_close(forward(experts, *one), cpu(experts, *one))  # said once


def test_default_path_is_deterministic_under_deterministic_algorithms():
    model = tiny_moe(num_experts=6)
    input_ids = token_batch(batch_size=4, length=40)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad():
            first, second = model(input_ids).logits, model(input_ids).logits
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(first, second)


@torch.no_grad()
def test_bf16_forward():
    model = tiny_moe()
    input_ids = token_batch()
    reference = model(input_ids).logits
    logits = model.to(torch.bfloat16)(input_ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    torch.testing.assert_close(logits.float(), reference, atol=0.05, rtol=0.05)


# ----------------------------------------------------------------------------------------------------------------
# Attention, caches, generation, torch.compile


@pytest.mark.smoke
@pytest.mark.parametrize("compensation", [False, True])
def test_static_cache_generation_equals_the_dynamic_cache(compensation):
    model = tiny_moe(num_shared_experts=1, moe_compensation=compensation, router_type="noisy_top_k")
    input_ids = token_batch(batch_size=1, length=6)
    kwargs = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    dynamic = model.generate(input_ids, **{CACHE_ARG: DynamicCache(config=model.config)}, **kwargs)
    static = model.generate(input_ids, cache_implementation="static", **kwargs)
    uncached = model.generate(input_ids, use_cache=False, **kwargs)
    assert dynamic.shape == (1, 16)
    assert torch.equal(static, dynamic) and torch.equal(uncached, dynamic)


@pytest.mark.parametrize(
    "device, tokens, compiling, kernel",
    [
        ("cpu", 1, False, "llama_moe_cpu"),
        ("cpu", 8, False, "llama_moe_cpu"),
        ("cpu", 1, True, "indexed_reduction"),
        ("cpu", 8, True, "grouped_mm"),
        ("meta", 1, False, "batched_mm"),
        ("meta", 1, True, "grouped_mm"),
        ("meta", 8, False, "grouped_mm"),
    ],
)
def test_the_default_experts_kernel_by_device_size_and_compilation(monkeypatch, device, tokens, compiling, kernel):
    """`llama_moe_auto`'s dispatch; a "meta" tensor stands for a GPU's. Decoding-sized inputs are T * k <= E."""
    calls = []
    for name in ("llama_moe_cpu", "indexed_reduction", "batched_mm", "grouped_mm"):
        monkeypatch.setattr(moe_kernels, f"{name}_experts_forward", lambda *args, name=name: calls.append(name))
    monkeypatch.setattr(moe_kernels, "is_torchdynamo_compiling", lambda: compiling)
    experts = tiny_moe().model.layers[0].mlp.experts  # 4 experts, top-2
    index = torch.zeros(tokens, 2, dtype=torch.long, device=device)
    hidden_states = torch.zeros(tokens, experts.gate_up_proj.shape[-1], device=device)
    moe_kernels.llama_moe_auto_experts_forward(experts, hidden_states, index, index.float())
    assert calls == [kernel]


@pytest.mark.smoke
@torch.no_grad()
def test_a_compiled_decoding_step_has_no_graph_break_and_matches_eager():
    """`fullgraph=True` fails on any graph break. Under compile on CPU a decoding step (here 2 tokens x top-2 of 4
    experts) runs the indexed reduction (`indexed_reduction_experts_forward`), longer inputs transformers'
    grouped_mm."""
    assert LlamaMoEForCausalLM._can_compile_fullgraph
    model = tiny_moe(num_shared_experts=1, moe_compensation=True)
    input_ids, next_token = token_batch(batch_size=2, length=6), token_batch(batch_size=2, length=1, seed=1)
    caches = [StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    for cache in caches:
        model(input_ids, cache=cache, use_cache=True)
    expected = model(next_token, cache=caches[0], use_cache=True).logits
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    torch.testing.assert_close(
        compiled(input_ids=next_token, cache=caches[1], use_cache=True).logits, expected, atol=1e-5, rtol=1e-4
    )


@pytest.mark.smoke
def test_greedy_generation_with_cache_equals_without():
    model = tiny_moe()
    input_ids = token_batch(batch_size=1, length=6)
    kwargs = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    cached = model.generate(input_ids, **{CACHE_ARG: DynamicCache(config=model.config)}, **kwargs)
    assert torch.equal(cached, model.generate(input_ids, use_cache=False, **kwargs))


@pytest.mark.smoke
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
@pytest.mark.parametrize("implementation", ["eager", "flex_attention"])
def test_attention_implementations_equal_sdpa(implementation):
    model = tiny_moe()
    input_ids = token_batch()
    model.set_attn_implementation("sdpa")
    sdpa = model(input_ids).logits
    model.set_attn_implementation(implementation)
    torch.testing.assert_close(model(input_ids).logits, sdpa, atol=1e-5, rtol=1e-4)


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
# Router outputs and losses


def test_router_logits_and_the_balance_loss_in_loss():
    model = tiny_moe(num_experts=5, moe_layers=[1], router_aux_loss_coef=0.02)
    input_ids = token_batch(batch_size=2, length=7)
    plain = model(input_ids, labels=input_ids)
    assert plain.aux_loss is None and not plain.router_logits
    out = model(input_ids, labels=input_ids, output_router_logits=True)
    assert len(out.router_logits) == 1 and out.router_logits[0].shape == (14, 5)  # one MoE layer
    torch.testing.assert_close(out.aux_loss, load_balancing_loss_func(out.router_logits, 5, 2))
    torch.testing.assert_close(out.loss, plain.loss + 0.02 * out.aux_loss)


def test_z_loss_is_part_of_the_loss_in_training():
    """In training the head adds the z-loss to `loss`: value and gradients equal lm + balance + z written out."""
    input_ids = token_batch()
    with_z = tiny_moe(router_aux_loss_coef=0.02, router_z_loss_coef=0.5).train()
    without_z = tiny_moe(router_aux_loss_coef=0.02, router_z_loss_coef=0.0).train()
    out = with_z(input_ids, labels=input_ids, output_router_logits=True)
    out.loss.backward()
    reference = without_z(input_ids, labels=input_ids, output_router_logits=True)
    total = reference.loss + 0.5 * router_z_loss_func(reference.router_logits)
    torch.testing.assert_close(out.loss, total)
    total.backward()
    for (name, param), other in zip(with_z.named_parameters(), without_z.parameters()):
        torch.testing.assert_close(param.grad, other.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert with_z.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_aux_loss_alone_trains_the_router():
    """The load-balancing loss must have a gradient (LLaMA-MoE-v2's copy of the old loss had none)."""
    model = tiny_moe(output_router_logits=True)
    model(token_batch()).aux_loss.backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
    assert model.model.layers[-1].mlp.experts.down_proj.grad is None  # only routing probabilities enter the loss


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
# Heads, parallel plans, checkpoint format


def test_sequence_and_token_classification_heads(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    moe = tiny_moe(num_shared_experts=1)
    moe.config.pad_token_id, moe.config.num_labels = 0, 3
    moe.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    input_ids = torch.cat([token_batch(batch_size=2, length=7), torch.zeros(2, 2, dtype=torch.long)], dim=1)
    for auto_class, shape in (
        (AutoModelForSequenceClassification, (2, 3)),
        (AutoModelForTokenClassification, (2, 9, 3)),
    ):
        assert saved[auto_class.__name__].startswith("modeling_llama_moe.LlamaMoEFor")
        head, info = auto_class.from_pretrained(tmp_path, output_loading_info=True)
        assert type(head).__name__ == saved[auto_class.__name__].split(".")[1]
        assert set(info["missing_keys"]) == {"score.weight", "score.bias"} & set(head.state_dict())
        torch.testing.assert_close(head.model.embed_tokens.weight, moe.model.embed_tokens.weight)
        assert head.eval()(input_ids).logits.shape == shape


@pytest.mark.parametrize("family", ["llama_moe", "attn_moe", "soap_moe"])
def test_question_answering_head_of_every_family_loads_from_a_causal_lm_folder(family, tmp_path):
    """Each family has an extractive QA head (as Mixtral has), named in `auto_map` and loaded by
    AutoModelForQuestionAnswering on the saved backbone; only `qa_outputs` is new, and its loss trains."""
    from transformers import AutoModelForQuestionAnswering

    moe = tiny_family_model(family)
    moe.save_pretrained(tmp_path)
    prefix = type(moe).__name__.removesuffix("ForCausalLM")
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert (
        auto_map["AutoModelForQuestionAnswering"]
        == f"{type(moe).__module__.split('.')[-1]}.{prefix}ForQuestionAnswering"
    )
    head, info = AutoModelForQuestionAnswering.from_pretrained(tmp_path, output_loading_info=True)
    assert type(head).__name__ == f"{prefix}ForQuestionAnswering"
    assert set(info["missing_keys"]) == {"qa_outputs.weight", "qa_outputs.bias"}
    torch.testing.assert_close(head.model.embed_tokens.weight, moe.model.embed_tokens.weight)
    input_ids = token_batch(batch_size=2, length=9)
    out = head.train()(input_ids, start_positions=torch.tensor([1, 4]), end_positions=torch.tensor([3, 8]))
    assert out.start_logits.shape == out.end_logits.shape == (2, 9)
    out.loss.backward()
    assert head.qa_outputs.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "fields",
    [{}, {"num_shared_experts": 1, "moe_layers": [1]}, {"moe_layers": [0, 1], "num_shared_experts": 2}],
    ids=["all-moe", "shared-and-dense", "shared"],
)
def test_parallel_plans_name_real_parameters(fields):
    """Every rule of the tensor- and expert-parallel plans matches parameters or modules of the model its config
    builds (transformers' common tests treat a rule that matches nothing as a mistake)."""
    import re

    model = tiny_moe(**fields)
    names = {
        re.sub(r"\.\d+\.", ".*.", name) for name, _ in [*model.model.named_parameters(), *model.model.named_modules()]
    }
    for plan in (model.config.base_model_tp_plan, model.config.base_model_ep_plan):
        for pattern in plan:
            assert any(n == pattern or n.startswith(pattern + ".") for n in names), pattern
    assert {"layers.*.mlp.experts.gate_up_proj", "layers.*.mlp.experts"} <= set(model.config.base_model_tp_plan)
    assert ("layers.*.mlp.shared_experts.up_proj" in model.config.base_model_tp_plan) == bool(fields)


SHARED_CODE = {"cache_compat.py", "moe_kernels.py", "router_losses.py", "routers.py", "save_hooks.py"}
SAVED_CODE = {
    "llama_moe": SHARED_CODE | {"configuration_llama_moe.py", "modeling_llama_moe.py"},
    "attn_moe": SHARED_CODE
    | {"configuration_llama_moe.py", "modeling_llama_moe.py", "configuration_attn_moe.py", "modeling_attn_moe.py"},
    "soap_moe": SHARED_CODE
    | {"configuration_llama_moe.py", "modeling_llama_moe.py", "configuration_soap_moe.py", "modeling_soap_moe.py"}
    | {"soap_kernels.py"},
}


@pytest.mark.parametrize("family", sorted(SAVED_CODE))
def test_saved_code_is_every_relatively_imported_file_and_imports_only_torch_and_transformers(family, tmp_path):
    """`save_pretrained` copies the modeling file and every file it imports relatively (recursively) next to the
    config; those files import nothing of this package, only the standard library, torch, transformers (and what
    transformers itself needs) and each other."""
    import ast
    import sys

    tiny_family_model(family).save_pretrained(tmp_path)
    saved = {path.name for path in tmp_path.glob("*.py")}
    assert saved == SAVED_CODE[family]
    allowed = {"torch", "transformers", "huggingface_hub", "packaging", *sys.stdlib_module_names}
    for name in saved:
        for node in ast.walk(ast.parse((tmp_path / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and f"{node.module}.py" in saved, (name, node.module)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
                assert all(module.split(".")[0] in allowed for module in modules), (name, modules)


def test_save_and_load_round_trip(tmp_path):
    dense = tiny_llama(num_hidden_layers=3)
    moe = build_moe(dense, num_experts=3, top_k=2, num_shared_experts=1, moe_layers=["0,2"], router_type="switch")
    moe.config.router_aux_loss_coef = 0.05
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

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LlamaMoEForCausalLM
    for field in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "num_shared_experts",
        "score_scale_factor",
        "router_type",
        "router_aux_loss_coef",
        "moe_layers",
        "conversion_info",
        "num_key_value_heads",
    ):
        assert getattr(loaded.config, field) == getattr(moe.config, field), field
    for name, tensor in moe.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(token_batch()).logits, moe(token_batch()).logits, atol=0, rtol=0)

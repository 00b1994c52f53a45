"""AttnMoE: attention heads as experts under grouped-query attention (LLaMA-MoE v2)."""

import json

import pytest
import torch
from helpers import load_as_remote_code, tiny_llama, tiny_llama_config
from transformers import AutoModelForCausalLM, LlamaForCausalLM, StaticCache
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from llama_moe.commands import main
from llama_moe.conversion.routers.fit.attention_fit import expert_output_norms, fit_attention_router
from llama_moe.conversion.statistics import collect_calibration
from llama_moe.source_families import dense_config_fields
from llama_moe_hf import AttnMoEConfig, AttnMoEForCausalLM, build_moe, convert_to_moe
from llama_moe_hf.modeling import modeling_attn_moe
from llama_moe_hf.modeling.cache_compat import CACHE_ARG, output_cache
from llama_moe_hf.modeling.modeling_attn_moe import AttnMoEAttention
from llama_moe_hf.modeling.router_losses import router_z_loss_func

# (query heads, KV heads, hidden size): 32/8-style and 9/3-style grouped-query attention.
GQA_SHAPES = [(32, 8, 128), (9, 3, 72)]


def dense_model(num_heads=8, num_kv_heads=2, hidden_size=64, seed=0, **overrides) -> LlamaForCausalLM:
    return tiny_llama(
        seed, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, hidden_size=hidden_size, **overrides
    )


def attn_config(dense_config, **fields) -> AttnMoEConfig:
    return AttnMoEConfig(**dense_config_fields(dense_config), **fields)


def all_experts(num_experts: int, **fields) -> dict:
    """Every expert selected with unit weight: top-k = E, zero router (weights 1/E), scale factor E."""
    return dict(
        family="attn_moe",
        attn_experts=num_experts,
        attn_top_k=num_experts,
        attn_score_scale_factor=float(num_experts),
        attn_router_init="zero",
        **fields,
    )


def batch_of_ids(vocab_size=128, batch=2, length=12, seed=1) -> torch.LongTensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# Config: groupings and top-k
# ---------------------------------------------------------------------------------------------------------------


def test_granularity_is_inferred_and_checked():
    tiny_config = tiny_llama_config()
    config = attn_config(tiny_config, num_attention_experts=2)  # 8 query heads / 2 KV heads
    assert (config.attention_expert_granularity, config.heads_per_attention_expert) == ("kv_group", 4)
    config = attn_config(tiny_config, num_attention_experts=8, num_attention_experts_per_tok=3)
    assert (config.attention_expert_granularity, config.heads_per_attention_expert) == ("query_heads", 1)
    # MLP dense by default: the MoE fields describe the attention routers (what TRL's aux loss reads).
    assert config.moe_layers == [] and (config.num_experts, config.num_experts_per_tok) == (8, 3)
    assert config.attention_moe_layers == [0, 1]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_attention_experts=3), r"Valid counts: \[2, 4, 8\]"),  # 3 does not divide the heads
        (
            dict(num_attention_experts=4, attention_expert_granularity="kv_group"),
            r"whole groups.*Valid counts: \[1, 2\]",
        ),
        (dict(num_attention_experts=1, attention_expert_granularity="query_heads"), "split a KV head"),
        (dict(num_attention_experts=2, attention_expert_granularity="heads"), "Unknown attention_expert_granularity"),
        (dict(num_attention_experts=4, num_attention_experts_per_tok=5), r"between 1 and num_attention_experts=4"),
        (dict(num_attention_experts=4, num_attention_experts_per_tok=0), r"between 1 and num_attention_experts=4"),
        (dict(attention_router_type="best"), "Unknown attention_router_type"),
        (dict(attention_score_scale_factor=[1.0, 2.0, 3.0]), "one value per layer"),
        (dict(attention_moe_layers=[0, 5]), r"attention_moe_layers \[5\] are outside"),
    ],
)
def test_bad_settings_give_one_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        attn_config(tiny_llama_config(), **fields)


def test_grouping_that_splits_a_kv_head_is_refused():
    # 12 query heads / 3 KV heads (groups of 4): 2 experts of 6 heads would cut group 1 in half.
    config = tiny_llama_config(num_attention_heads=12, num_key_value_heads=3, hidden_size=96)
    with pytest.raises(ValueError, match="split a KV head"):
        attn_config(config, num_attention_experts=2, attention_expert_granularity="query_heads")
    with pytest.raises(ValueError, match=r"Valid counts: \[1, 3\]"):
        attn_config(config, num_attention_experts=2)


# ---------------------------------------------------------------------------------------------------------------
# Exact invariants
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_heads, num_kv_heads, hidden_size", GQA_SHAPES)
def test_all_experts_with_unit_weights_is_the_dense_model(num_heads, num_kv_heads, hidden_size):
    dense = dense_model(num_heads, num_kv_heads, hidden_size)
    ids = batch_of_ids()
    with torch.no_grad():
        expected = dense(ids).logits
    counts = {c for g in ("kv_group", "query_heads") for c in _valid_counts(num_heads, num_kv_heads, g)}
    assert len(counts) >= 3  # e.g. 9/3: 1 or 3 whole groups, or single query heads
    for num_experts in sorted(counts):
        model = build_moe(dense, **all_experts(num_experts))
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, atol=1e-4, rtol=0)


def _valid_counts(num_heads, num_kv_heads, granularity):
    from llama_moe_hf.modeling.configuration_attn_moe import valid_attention_expert_counts

    return valid_attention_expert_counts(num_heads, num_kv_heads, granularity)


@pytest.mark.parametrize("num_experts, top_k, router_type", [(2, 1, "top_k"), (4, 2, "switch"), (8, 3, "top_k")])
def test_output_is_the_weighted_sum_of_expert_outputs(num_experts, top_k, router_type):
    """Against an independent reference: dense LlamaAttention per-head outputs, each expert through its o_proj slice."""
    dense = dense_model()
    model = build_moe(
        dense,
        family="attn_moe",
        attn_experts=num_experts,
        attn_top_k=top_k,
        attn_router_type=router_type,
        attn_score_scale_factor=1.7,
    )
    attention = model.model.layers[0].self_attn
    torch.nn.init.normal_(attention.gate.weight, std=1.0)  # decisive routing
    hidden = torch.randn(2, 7, 64)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(7)[None])
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]

    heads = {}
    dense_attention = dense.model.layers[0].self_attn
    handle = dense_attention.o_proj.register_forward_pre_hook(lambda m, args: heads.update(x=args[0]))
    with torch.no_grad():
        dense_attention(hidden, position_embeddings=position_embeddings, attention_mask=mask)
        output, _ = attention(hidden, position_embeddings=position_embeddings, attention_mask=mask)
        _, weights, index = attention.gate(hidden)
    handle.remove()

    per_head = heads["x"].reshape(14, num_experts, -1)  # [T, E, n*D]
    o_proj = dense_attention.o_proj.weight.view(64, num_experts, -1)  # [H, E, n*D]
    reference = torch.zeros(14, 64)
    for token in range(14):
        for weight, expert in zip(weights[token], index[token]):
            reference[token] += 1.7 * weight * (o_proj[:, expert] @ per_head[token, expert])
    torch.testing.assert_close(output.reshape(14, 64), reference, atol=1e-5, rtol=1e-5)
    if router_type == "top_k":
        assert torch.allclose(weights.sum(-1), torch.ones(14))


def test_smollm2_all_experts_is_the_dense_model(smollm2, real_text):
    dense, tokenizer = smollm2
    ids = tokenizer(real_text[:2], return_tensors="pt", padding=True, truncation=True, max_length=32)
    with torch.no_grad():
        expected = dense(**ids).logits
    for num_experts in (3, 9):  # whole KV groups (3 heads each); single query heads
        model = build_moe(dense, **all_experts(num_experts))
        with torch.no_grad():
            logits = model(**ids).logits
        mask = ids["attention_mask"].bool()
        torch.testing.assert_close(logits[mask], expected[mask], atol=1e-4, rtol=0)
        del model


# ---------------------------------------------------------------------------------------------------------------
# Cache, batching, attention implementations
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def routed_smollm2(smollm2):
    """SmolLM2 with 9 attention experts (one query head each), top-6, random routers, scale 6 (kept heads ~ unit)."""
    model = build_moe(smollm2[0], family="attn_moe", attn_experts=9, attn_top_k=6, attn_score_scale_factor=6.0, seed=3)
    return model, smollm2[1]


@pytest.mark.smoke
def test_generation_with_cache_equals_without(routed_smollm2):
    model, tokenizer = routed_smollm2
    ids = tokenizer(["The standard library module for regular expressions is"], return_tensors="pt")
    with torch.no_grad():
        cached = model.generate(**ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, use_cache=True)
        uncached = model.generate(**ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, use_cache=False)
        # And the logits of a cached step equal those of the full forward.
        full = model(cached).logits[0, -1]
        prefix = model(cached[:, :-1], use_cache=True)
        step = model(cached[:, -1:], cache=output_cache(prefix)).logits[0, -1]
    assert torch.equal(cached, uncached)
    # Routing is identical; this untrained model's ~1000-sized activations on the last token amplify float32 noise
    # to ~3e-3 (1e-4 relative). A wrong cache would be off by whole logits.
    torch.testing.assert_close(step, full, atol=1e-2, rtol=0)


@pytest.mark.smoke
def test_cached_decoding_equals_the_full_forward_tiny():
    model = build_moe(dense_model(), family="attn_moe", attn_experts=8, attn_top_k=3)
    ids = batch_of_ids(length=12)
    with torch.no_grad():
        full = model(ids).logits
        cache = output_cache(model(ids[:, :8], use_cache=True))
        steps = [model(ids[:, i : i + 1], cache=cache).logits for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 8:], atol=1e-5, rtol=0)


@pytest.mark.smoke
def test_left_padded_batch_generation_equals_one_by_one(routed_smollm2):
    model, tokenizer = routed_smollm2
    prompts = ["Return the absolute value of a number.", "Open a file and return a stream for it, in text mode"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    assert (batch["attention_mask"] == 0).any()
    fixed_length = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)  # no early stop at EOS
    with torch.no_grad():
        batched = model.generate(**batch, **fixed_length)
        for row, prompt in enumerate(prompts):
            single = model.generate(**tokenizer([prompt], return_tensors="pt"), **fixed_length)
            assert batched[row, -5:].tolist() == single[0, -5:].tolist()


@pytest.mark.smoke
def test_beam_search_with_cache_equals_without():
    # Large init: decisive logits, so the beams do not hinge on float noise.
    dense = dense_model(initializer_range=0.5)
    model = build_moe(dense, family="attn_moe", attn_experts=4, attn_top_k=2)
    ids = batch_of_ids(batch=1, length=6)
    beams = dict(max_new_tokens=6, min_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **beams)
        uncached = model.generate(ids, use_cache=False, **beams)
    assert torch.equal(cached, uncached)


def test_eager_equals_sdpa_with_padding():
    dense = dense_model()
    model = build_moe(dense, family="attn_moe", attn_experts=4, attn_top_k=2)
    ids = batch_of_ids(length=10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    outputs = {}
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            outputs[implementation] = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(outputs["eager"][keep], outputs["sdpa"][keep], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Router logits and aux loss (model forward and TRL's fused head)
# ---------------------------------------------------------------------------------------------------------------


def test_attention_only_router_logits_and_aux_loss_match_trl():
    from trl.trainer.utils import add_fused_lm_head

    model = build_moe(dense_model(), family="attn_moe", attn_experts=4, attn_top_k=2)
    ids = batch_of_ids()
    out = model(ids, labels=ids, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (24, 4)
    assert out.attention_router_logits == out.router_logits
    expected = load_balancing_loss_func(out.router_logits, 4, 2, None)
    torch.testing.assert_close(out.aux_loss, expected)
    lm_loss = model(ids, labels=ids).loss
    torch.testing.assert_close(out.loss, lm_loss + 0.01 * expected)

    add_fused_lm_head(model)  # what TRL's SFTTrainer does: it reads config.num_experts / num_experts_per_tok
    fused = model(ids, labels=ids, fused_lm_head=True, output_router_logits=True)
    torch.testing.assert_close(fused.aux_loss, out.aux_loss)
    fused.loss.backward()
    assert model.model.layers[0].self_attn.gate.weight.grad.abs().sum() > 0


def test_combined_with_mlp_moe_reports_both_router_groups():
    model = build_moe(
        dense_model(), family="attn_moe", attn_experts=2, attn_top_k=1, attn_layers=["1"], mlp_moe=True, num_experts=4
    )
    ids = batch_of_ids()
    out = model(ids, output_router_logits=True)
    assert [t.shape for t in out.router_logits] == [(24, 4), (24, 4)]  # MLP routers
    assert [t.shape for t in out.attention_router_logits] == [(24, 2)]  # attention router of layer 1 only
    torch.testing.assert_close(out.aux_loss, load_balancing_loss_func(out.router_logits, 4, 2))
    torch.testing.assert_close(out.attention_aux_loss, load_balancing_loss_func(out.attention_router_logits, 2, 1))
    assert not isinstance(model.model.layers[0].self_attn, AttnMoEAttention)


@pytest.mark.parametrize("implementation", ["grouped_mm", "llama_moe_cpu"])
def test_mlp_experts_implementation_can_be_switched(implementation):
    model = build_moe(dense_model(), family="attn_moe", attn_experts=2, mlp_moe=True, num_experts=4)
    ids = batch_of_ids()
    with torch.no_grad():
        model.set_experts_implementation("eager")
        expected = model(ids).logits
        model.set_experts_implementation(implementation)
        assert model.model.layers[0].mlp.experts.config._experts_implementation == implementation
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-4)


def test_attention_balance_and_z_losses_reach_the_gradients_in_training():
    """With an MLP MoE, `router_logits` (what the head and TRL weight) are the MLP routers': the attention routers'
    balance loss and every router's z-loss still reach `loss` (and the gradients) when the head computes it."""
    ids = batch_of_ids()
    fields = dict(family="attn_moe", attn_experts=4, attn_top_k=2, mlp_moe=True, num_experts=4)
    model = build_moe(dense_model(), **fields).train()
    model.config.router_z_loss_coef = 0.3
    reference = build_moe(dense_model(), **fields).train()
    for layer in [*model.model.layers, *reference.model.layers]:
        layer.self_attn.z_loss_weight = layer.mlp.z_loss_weight = 0.3 / 4  # the config's coef over 4 routers
    for layer in reference.model.layers:
        layer.self_attn.z_loss_weight = layer.mlp.z_loss_weight = 0.0
    reference.config.router_aux_loss_coef = 0.0  # no in-graph attention balance: written out below
    out = model(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    ref = reference(ids, labels=ids, output_router_logits=True)
    total = ref.loss + 0.01 * (ref.aux_loss + ref.attention_aux_loss)
    total = total + 0.3 * router_z_loss_func(ref.router_logits + ref.attention_router_logits)
    torch.testing.assert_close(out.loss, total)
    total.backward()
    for (name, param), other in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, other.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert model.model.layers[0].self_attn.gate.weight.grad.abs().sum() > 0


def test_combined_all_experts_is_the_dense_model():
    dense = dense_model()
    model = build_moe(
        dense, mlp_moe=True, num_experts=4, top_k=4, router_init="zero", score_scale_factor=4.0, **all_experts(4)
    )
    ids = batch_of_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.smoke
@torch.no_grad()
def test_static_cache_and_compiled_decoding():
    model = build_moe(dense_model(), family="attn_moe", attn_experts=8, attn_top_k=3, mlp_moe=True, num_experts=4)
    ids = batch_of_ids(batch=1, length=6)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kwargs), model.generate(ids, **kwargs))
    model.config.attention_experts_implementation = "gathered"  # falls back to masked under compile / static cache
    caches = [StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    for cache in caches:
        model(ids, cache=cache, use_cache=True)
    expected = model(ids[:, -1:], cache=caches[0], use_cache=True).logits
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    got = compiled(input_ids=ids[:, -1:], cache=caches[1], use_cache=True).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_generate_compiles_attn_moe_only_on_a_cpu(monkeypatch):
    """Compiled for an H200, AttnMoE's decoding step gave wrong tokens (docs/benchmarks.md); compiled on a CPU it
    matches eager. So `generate` with a static cache compiles it where asked on a CPU and never on another device."""
    from transformers import CompileConfig, GenerationConfig

    model = AttnMoEForCausalLM(attn_config(tiny_llama_config(), num_attention_experts=2))
    cache = StaticCache(config=model.config, max_cache_len=16)
    config = GenerationConfig(compile_config=CompileConfig())
    config.compile_config._compile_all_devices = True  # how generate is made to compile on a CPU
    assert model._valid_auto_compile_criteria({CACHE_ARG: cache}, config)
    assert not model._valid_auto_compile_criteria({CACHE_ARG: cache}, GenerationConfig())  # not asked
    monkeypatch.setattr(AttnMoEForCausalLM, "device", property(lambda self: torch.device("cuda")))
    assert not model._valid_auto_compile_criteria({CACHE_ARG: cache}, config)
    assert not model._valid_auto_compile_criteria({CACHE_ARG: cache}, GenerationConfig())


# ---------------------------------------------------------------------------------------------------------------
# Saving, remote code, LoRA
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.smoke
def test_save_and_load_with_remote_code_in_a_fresh_process(tmp_path):
    model = build_moe(
        dense_model(),
        family="attn_moe",
        attn_experts=4,
        attn_top_k=2,
        mlp_moe=True,
        moe_layers=["1"],
        num_experts=4,
        top_k=1,
    )
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "attn_moe"
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_attn_moe.AttnMoEForCausalLM"
    assert saved["auto_map"]["AutoModelForTokenClassification"] == "modeling_attn_moe.AttnMoEForTokenClassification"
    assert saved["auto_map"]["AutoModelForQuestionAnswering"] == "modeling_attn_moe.AttnMoEForQuestionAnswering"
    for name in ("modeling_attn_moe.py", "configuration_attn_moe.py", "modeling_llama_moe.py"):
        assert (tmp_path / name).is_file()

    ids = batch_of_ids(batch=1)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(reloaded, AttnMoEForCausalLM)
    with torch.no_grad():
        expected = model(ids).logits[0, -1]
        torch.testing.assert_close(reloaded(ids).logits[0, -1], expected)
    module, remote_logits = load_as_remote_code(tmp_path, ids)
    assert module.startswith("transformers_modules")
    torch.testing.assert_close(remote_logits, expected, atol=1e-5, rtol=0)


def test_lora_adapter_trains():
    from peft import LoraConfig, get_peft_model

    model = build_moe(dense_model(), family="attn_moe", attn_experts=4, attn_top_k=2).train()
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0))
    ids = batch_of_ids(length=16)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids, output_router_logits=True).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert model.base_model.model.model.layers[0].self_attn.gate.weight.requires_grad is False


# ---------------------------------------------------------------------------------------------------------------
# Conversion helpers
# ---------------------------------------------------------------------------------------------------------------


def test_attention_conversion_keeps_the_projections_and_adds_seeded_routers():
    dense = dense_model()
    first, second = (build_moe(dense, family="attn_moe", attn_experts=4, attn_top_k=2, seed=1) for _ in range(2))
    zero = build_moe(dense, family="attn_moe", attn_experts=4, attn_top_k=2, attn_router_init="zero")
    state, dense_state = first.state_dict(), dense.state_dict()
    assert set(state) == set(dense_state) | {f"model.layers.{i}.self_attn.gate.weight" for i in (0, 1)}
    assert all(torch.equal(state[k], v) for k, v in dense_state.items())
    gate = "model.layers.1.self_attn.gate.weight"
    assert torch.equal(state[gate], second.state_dict()[gate]) and state[gate].std() > 0.01
    assert not zero.state_dict()[gate].any()


def test_fitted_router_prefers_the_experts_with_the_largest_outputs(smollm2, real_text):
    dense, tokenizer = smollm2
    ids = tokenizer(real_text[:8], return_tensors="pt", truncation=True, max_length=64, padding="max_length")
    calibration, held_out = ids["input_ids"][:6], ids["input_ids"][6:]
    stats = collect_calibration(dense, calibration, attention_experts={3: 9, 20: 9}, progress=False)
    routers = {layer: fit_attention_router(stats.attention[layer]) for layer in (3, 20)}

    # Held-out agreement of the fitted router's top-3 with the 3 largest expert outputs, vs 1/3 for a random pick.
    captured = {}
    attention = dense.model.layers[20].self_attn
    hooks = [
        attention.register_forward_pre_hook(lambda m, a, k: captured.update(x=k["hidden_states"]), with_kwargs=True),
        attention.o_proj.register_forward_pre_hook(lambda m, a: captured.update(heads=a[0])),
    ]
    with torch.no_grad():
        dense(held_out)
    for hook in hooks:
        hook.remove()
    x = captured["x"].reshape(-1, 576)
    norms = expert_output_norms(captured["heads"].reshape(x.shape[0], -1), attention.o_proj.weight, 9)
    predicted = (x @ routers[20].T).topk(3).indices
    best = norms.topk(3).indices
    overlap = (predicted[:, :, None] == best[:, None, :]).any(-1).float().mean()
    assert overlap > 0.5


@torch.no_grad()
def test_gathered_attention_still_returns_attention_weights_when_asked():
    model = build_moe(dense_model(), family="attn_moe", attn_experts=4, attn_top_k=2)
    model.config.attention_experts_implementation = "gathered"
    model.set_attn_implementation("eager")
    ids = batch_of_ids()
    assert len(model(ids, output_attentions=True).attentions) == 2
    model.config.output_attentions = True  # asked through the config, not the call
    assert len(model(ids).attentions) == 2
    assert "layers.*.mlp.experts" not in model.config.base_model_tp_plan  # a dense MLP: no expert rules


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("num_experts, top_k", [(2, 1), (8, 3)])
def test_gathered_implementation_equals_masked(implementation, num_experts, top_k):
    dense = dense_model(attention_bias=True)
    masked = build_moe(dense, family="attn_moe", attn_experts=num_experts, attn_top_k=top_k)
    gathered = build_moe(dense, family="attn_moe", attn_experts=num_experts, attn_top_k=top_k)
    gathered.config.attention_experts_implementation = "gathered"
    for model in (masked, gathered):
        model.set_attn_implementation(implementation)
    ids = batch_of_ids(length=10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    keep = mask.bool()
    with torch.no_grad():
        for attention_mask in (None, mask):
            expected = masked(ids, attention_mask=attention_mask).logits
            got = gathered(ids, attention_mask=attention_mask).logits
            rows = keep if attention_mask is not None else torch.ones_like(keep)
            torch.testing.assert_close(got[rows], expected[rows], atol=1e-5, rtol=1e-5)
        # Cached decoding, one token at a time.
        cache = output_cache(gathered(ids[:, :7], attention_mask=mask[:, :7], use_cache=True))
        for i in range(7, 10):
            step = gathered(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=cache).logits
            full = masked(ids[:, : i + 1], attention_mask=mask[:, : i + 1]).logits[:, -1:]
            torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Streaming converter: `llama-moe convert --attn-experts E --attn-top-k K [--mlp-moe ...]`
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dense_folder(tmp_path_factory):
    """A real dense checkpoint on disk (safetensors): 8 query / 2 KV heads."""
    path = tmp_path_factory.mktemp("dense")
    model = dense_model(seed=5)
    model.save_pretrained(path)
    return path, model


def test_converter_all_experts_reproduces_dense(tmp_path, tiny_dense_folder):
    path, dense = tiny_dense_folder
    result = convert_to_moe(
        path,
        tmp_path / "out",
        family="attn_moe",
        attn_experts=8,
        attn_top_k=8,
        attn_router_init="zero",
        attn_score_scale_factor=8.0,
        progress=False,
    )
    model = AutoModelForCausalLM.from_pretrained(result.output_dir).eval()
    assert isinstance(model, AttnMoEForCausalLM) and model.config.moe_layers == []
    assert model.config.attention_expert_granularity == "query_heads"
    ids = batch_of_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, atol=1e-4, rtol=0)
    assert result.active_parameters == result.total_parameters  # every head active


def test_converter_combined_with_mlp_moe(tmp_path, tiny_dense_folder):
    from safetensors import safe_open

    path, _ = tiny_dense_folder
    result = convert_to_moe(
        path,
        tmp_path / "out",
        family="attn_moe",
        attn_experts=2,
        attn_top_k=1,
        mlp_moe=True,
        num_experts=4,
        top_k=2,
        progress=False,
    )
    out = result.output_dir
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.1.self_attn.gate.weight").shape == (2, 64)
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"} <= keys
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_experts"], config["num_experts"], config["moe_layers"]) == (2, 4, [0, 1])
    assert config["attention_score_scale_factor"] == 1.0  # default: the attention top-k
    card = (out / "README.md").read_text()
    assert "| Attention experts per layer | 2 (4 query head(s) each, granularity `kv_group`" in card
    assert "| Routed experts per MoE layer | 4 |" in card and "attn-moe" in card
    # Active parameters: half of q_proj/o_proj (1 of 2 attention experts), half of the MLP experts (2 of 4).
    q_and_o = 2 * 2 * 64 * 64
    experts = 2 * 3 * 96 * 64
    assert result.total_parameters - result.active_parameters == q_and_o // 2 + experts // 2
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    out = model(batch_of_ids(), output_router_logits=True)
    assert out.aux_loss is not None and out.attention_aux_loss is not None


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(family="attn_moe", attn_experts=3), r"Valid counts: \[2, 4, 8\]"),
        (dict(family="attn_moe", attn_experts=4, attn_top_k=5), "between 1 and num_attention_experts=4"),
        (dict(family="attn_moe", attn_experts=4, num_experts=4), "--num-experts shape an MLP MoE; add --mlp-moe"),
        (
            dict(family="attn_moe", attn_experts=4, attn_router_init="kmeans"),
            "'kmeans' cannot start attention routers; choose one of fit, random, uniform_random, zero",
        ),
        (
            dict(family="attn_moe", attn_experts=4, attn_router_type="selector"),
            "A 'selector' router is made by router init selector",
        ),
        (dict(family="attn_moe", attn_experts=4, attn_granularity="kv_group"), r"whole groups.*Valid counts: \[1, 2\]"),
    ],
)
def test_converter_bad_attention_options(tmp_path, tiny_dense_folder, options, message):
    with pytest.raises(ValueError, match=message):
        convert_to_moe(tiny_dense_folder[0], tmp_path / "out", progress=False, **options)
    assert not (tmp_path / "out").exists()


def test_cli_attention_flags(tmp_path, tiny_dense_folder):
    out = tmp_path / "cli"
    args = [
        "convert",
        "--model",
        str(tiny_dense_folder[0]),
        "--output",
        str(out),
        "--no-progress",
        "--family",
        "attn_moe",
    ]
    assert main(args + ["--attn-experts", "4", "--attn-top-k", "2", "--attn-score-scale-factor", "1.5"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_experts_per_tok"], config["attention_score_scale_factor"]) == (2, 1.5)
    assert main(args + ["--attn-experts", "3"]) == 2  # one `error:` line, no traceback


def test_experts_kernel_switch_runs_the_mlp_experts_kernel_or_changes_nothing():
    """transformers' `experts_implementation` picks the MLP experts' kernel: with MLP experts the chosen kernel runs
    (transformers' common test mocks it the same way); with dense MLPs only it is accepted, as transformers' contract
    has it, and changes nothing (said once in the log), where it used to be refused."""
    from unittest.mock import Mock, patch

    from transformers.integrations.moe import batched_mm_experts_forward
    from transformers.testing_utils import CaptureLogger

    dense = dense_model()
    fields = dict(num_attention_experts=4, num_attention_experts_per_tok=2, num_experts=4, num_experts_per_tok=2)
    with_experts = AttnMoEForCausalLM(attn_config(dense.config, moe_layers=[0, 1], **fields)).eval()
    kernel = Mock(wraps=batched_mm_experts_forward)
    with patch.dict("transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS._global_mapping", {"batched_mm": kernel}):
        with_experts.set_experts_implementation("batched_mm")
        with_experts(torch.randint(3, 90, (1, 8)))
    kernel.assert_called()
    attention_only = AttnMoEForCausalLM(attn_config(dense.config, **fields)).eval()
    ids = torch.randint(3, 90, (2, 8))
    with torch.no_grad():
        expected = attention_only(ids).logits
        for implementation in ("batched_mm", "grouped_mm"):
            with CaptureLogger(modeling_attn_moe.logger) as log:
                attention_only.set_experts_implementation(implementation)
            assert attention_only.config._experts_implementation == implementation
            assert torch.equal(attention_only(ids).logits, expected)
            assert "has none (moe_layers is empty): it changes nothing" in log.out


@pytest.mark.parametrize("implementation", ["masked", "gathered"])
def test_attention_balance_loss_leaves_out_masked_left_padding_on_either_path(implementation):
    """Mixtral's common test, second part, with the attention routers in `router_logits` (dense MLPs): left padding
    under the mask leaves `aux_loss` as it was (a report once had the gathered path at 4.0 against 2.0 here), and
    the same padding counted (no mask) changes it."""
    fields = {"num_attention_experts": 4, "num_attention_experts_per_tok": 2, "output_router_logits": True}
    config = attn_config(dense_model().config, attention_experts_implementation=implementation, **fields)
    model = AttnMoEForCausalLM(config).eval()
    input_ids = batch_of_ids(length=7)
    padded = torch.cat([torch.ones(2, 28, dtype=torch.long), input_ids], dim=1)
    with torch.no_grad():
        alone = model(input_ids, attention_mask=input_ids.ne(1)).aux_loss  # token 1 is padding, as in Mixtral's test
        torch.testing.assert_close(model(padded, attention_mask=padded.ne(1)).aux_loss, alone, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(model(padded).aux_loss, alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("implementation", ["masked", "gathered"])
def test_attention_balance_loss_is_top_k_when_balanced_on_either_path(implementation):
    """The Switch loss is top-k for a uniform router (Mixtral's common test expects 2 for top-2); both attention
    paths report the same value for the same routing (with dense MLPs the attention loss is `aux_loss`)."""
    dense = dense_model()
    fields = dict(num_attention_experts=4, num_attention_experts_per_tok=2, output_router_logits=True)
    model = AttnMoEForCausalLM(attn_config(dense.config, attention_experts_implementation=implementation, **fields))
    input_ids = batch_of_ids()
    reference = AttnMoEForCausalLM(attn_config(dense.config, attention_experts_implementation="masked", **fields))
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        aux = model.eval()(input_ids, attention_mask=torch.ones_like(input_ids)).aux_loss
        expected = reference.eval()(input_ids, attention_mask=torch.ones_like(input_ids)).aux_loss
    torch.testing.assert_close(aux, expected)
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.self_attn.gate.weight)
    with torch.no_grad():
        balanced = model(input_ids).aux_loss
    torch.testing.assert_close(balanced, torch.tensor(2.0))

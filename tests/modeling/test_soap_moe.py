"""SoapMoE: soft-merged experts with causal segment routing (modeling, conversion, generation)."""

import json
import re

import pytest
import torch
from helpers import load_as_remote_code, load_moe, logits, tiny_llama, tiny_llama_config
from transformers import AutoModelForCausalLM
from transformers.generation import CompileConfig

from llama_moe.commands import main
from llama_moe.export.soap_dense import merged_dense_model
from llama_moe.source_families import dense_config_fields
from llama_moe_hf import SoapMoEConfig, SoapMoEForCausalLM, build_moe
from llama_moe_hf.modeling.cache_compat import output_cache

SEGMENT = 8


def soap_model(seed: int = 0, **fields) -> SoapMoEForCausalLM:
    """A tiny random SoapMoE (4 experts that differ, segments of 8 tokens), in eval mode."""
    torch.manual_seed(seed)
    fields = {"num_experts": 4, "segment_length": SEGMENT, "merge_chunk_size": 3} | fields
    model = SoapMoEForCausalLM(SoapMoEConfig(**(dense_config_fields(tiny_llama_config()) | fields))).eval()
    for layer in model.model.layers:  # a router far from uniform, so routing matters
        layer.mlp.gate.weight.data.normal_(0, 1.0)
    return model


def token_ids(batch: int = 2, length: int = 30, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 120, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# Exact identities
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("merge_top_k", [None, 2])
def test_upcycled_soap_moe_is_the_dense_model_whatever_the_routing(merge_top_k):
    dense = tiny_llama()
    moe = build_moe(dense, family="soap_moe", num_experts=4, options={"segment_length": 8, "merge_top_k": merge_top_k})
    for layer in moe.model.layers:
        layer.mlp.gate.weight.data.normal_(0, 10.0)  # any routing
    ids = token_ids(length=37)
    torch.testing.assert_close(logits(moe, ids), logits(dense, ids), atol=1e-5, rtol=1e-4)


def test_upcycled_real_model_keeps_the_dense_logits_on_real_text(smollm2, real_text):
    dense, tokenizer = smollm2
    moe = build_moe(dense, family="soap_moe", num_experts=2, moe_layers=["0-3"], options={"segment_length": 64})
    ids = tokenizer(" ".join(real_text[:40]), return_tensors="pt").input_ids[:, :200]
    with torch.no_grad():
        expected, got = dense(ids).logits, moe(ids, output_routing_weights=True)
    torch.testing.assert_close(got.logits, expected, atol=2e-4, rtol=1e-4)
    assert [tuple(w.shape) for w in got.routing_weights] == [(1, 4, 2)] * 4  # 200 tokens: 4 segments of 64


def test_noisy_upcycling_breaks_the_symmetry_but_stays_close():
    dense = tiny_llama()
    moe = build_moe(dense, family="soap_moe", num_experts=4, options={"upcycle_noise": 0.01})
    experts = moe.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(experts[0], experts[1])
    ids = token_ids()
    difference = (logits(moe, ids) - logits(dense, ids)).abs().max()
    assert 0 < difference < 0.05


@pytest.mark.parametrize("chunk", [3, 16])  # several chunks (merged again in backward), or one (kept)
@pytest.mark.parametrize("merge_top_k", [None, 2])
@pytest.mark.parametrize("act", ["silu", "gelu"])  # the hand-written SiLU backward, and autograd's for the others
def test_fast_chunked_path_matches_the_reference_path_in_values_and_gradients(merge_top_k, chunk, act):
    torch.manual_seed(0)
    model = soap_model(num_experts_per_tok=merge_top_k, merge_chunk_size=chunk, hidden_act=act)
    experts = model.model.layers[0].mlp.experts.double()
    assert experts.silu == (act == "silu")
    x = torch.randn(7, SEGMENT, 64, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(7, merge_top_k or 4, dtype=torch.float64, requires_grad=True)
    index = torch.arange(4).expand(7, 4) if merge_top_k is None else torch.rand(7, 4).topk(2).indices
    results = []
    for forward in (experts.forward, experts.reference_forward):
        output = forward(x, weights, index)
        grads = torch.autograd.grad(output.square().sum(), (x, weights, experts.gate_up_proj, experts.down_proj))
        results.append((output, *grads))
    for fast, reference in zip(*results):
        torch.testing.assert_close(fast, reference, atol=1e-12, rtol=1e-10)


def test_a_second_backward_of_the_same_graph_gives_the_same_gradients():
    """The fast path writes the merged weights' gradients over the merged weights it kept from the forward; every
    later backward (retain_graph) must merge again, not read those."""
    torch.manual_seed(0)
    experts = soap_model(merge_chunk_size=16).model.layers[0].mlp.experts.double()
    x = torch.randn(5, SEGMENT, 64, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(5, 4, dtype=torch.float64, requires_grad=True)
    loss = experts(x, weights, torch.arange(4).expand(5, 4)).square().sum()
    inputs = (x, weights, experts.gate_up_proj, experts.down_proj)
    first = torch.autograd.grad(loss, inputs, retain_graph=True)
    for retain in (True, False):  # a second and a third backward
        for again, expected in zip(torch.autograd.grad(loss, inputs, retain_graph=retain), first):
            torch.testing.assert_close(again, expected, atol=0, rtol=0)


def test_activation_checkpointing_gives_the_same_gradients():
    """Checkpointing recomputes the fast path's forward (its kept merged weights included) in backward."""
    model = soap_model(merge_chunk_size=16).train()
    ids = token_ids(length=3 * SEGMENT)

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected = grads()
    model.activation_checkpointing_enable()
    actual = grads()
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, atol=1e-6, rtol=1e-4, msg=name)


# ---------------------------------------------------------------------------------------------------------------
# Causal segment routing
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [SEGMENT, SEGMENT + 3, 2 * SEGMENT, 3 * SEGMENT - 1, 3 * SEGMENT + 5])
def test_later_tokens_never_change_earlier_logits_across_segment_borders(t):
    model = soap_model()
    ids = token_ids(length=4 * SEGMENT)
    changed = ids.clone()
    changed[:, t:] = token_ids(length=4 * SEGMENT, seed=1)[:, t:]
    before, after = logits(model, ids), logits(model, changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], atol=0, rtol=0)
    assert not torch.allclose(after[:, t:], before[:, t:])


def test_segments_are_routed_by_the_previous_segment_and_segment_0_by_itself():
    """SOAP's first segment routes on its own mean (a change inside it changes its routing); every later segment is
    routed by the one before it, so a change in segment j moves the routing of segment j + 1 only."""
    model = soap_model()
    ids = token_ids(batch=1, length=3 * SEGMENT)

    def weights(input_ids):
        with torch.no_grad():
            return model(input_ids, output_routing_weights=True).routing_weights[0][0]  # [segments, E]

    base = weights(ids)
    in_segment_0, in_segment_1 = ids.clone(), ids.clone()
    in_segment_0[0, SEGMENT - 1] += 1
    in_segment_1[0, SEGMENT + 1] += 1
    assert not torch.allclose(weights(in_segment_0)[0], base[0])
    moved = weights(in_segment_1)
    torch.testing.assert_close(moved[:2], base[:2], atol=0, rtol=0)
    assert not torch.allclose(moved[2], base[2])


def test_segment_0_routing_gets_no_gradient_later_segments_do():
    model = soap_model().train()
    one_segment, two_segments = token_ids(length=SEGMENT), token_ids(length=2 * SEGMENT)
    model(one_segment, labels=one_segment).loss.backward()
    router_grads = [layer.mlp.gate.weight.grad for layer in model.model.layers]
    assert all(grad is None or not grad.any() for grad in router_grads)
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0  # experts still learn
    model.zero_grad()
    model(two_segments, labels=two_segments).loss.backward()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in model.model.layers)


def test_training_routes_by_segments_in_either_routing_mode():
    """`routing_mode` is for generation: a training forward (which gets a cache by default) routes by segments."""
    ids = token_ids(length=4 * SEGMENT)
    losses = [soap_model(routing_mode=mode).train()(ids, labels=ids).loss for mode in ("segment", "prompt")]
    torch.testing.assert_close(losses[1], losses[0], atol=0, rtol=0)


def test_padding_is_left_out_of_the_segment_means():
    model = soap_model()
    short, long = token_ids(batch=1, length=5), token_ids(batch=1, length=2 * SEGMENT + 3, seed=2)
    batch = torch.cat([torch.nn.functional.pad(short, (0, long.shape[1] - 5)), long])
    mask = (torch.arange(long.shape[1]) < torch.tensor([[5], [long.shape[1]]])).long()
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(padded[:1, :5], logits(model, short), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(padded[1:], logits(model, long), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_left_padding_changes_nothing_segments_count_from_each_rows_first_token():
    """A left-padded batch gives each row the logits it has alone, and batched generation (segment borders crossed
    at different steps in each row) the tokens and scores of one-by-one generation."""
    model = soap_model(routing_mode="segment")
    short, long = token_ids(batch=1, length=SEGMENT + 3, seed=3), token_ids(batch=1, length=2 * SEGMENT + 5, seed=4)
    pad = long.shape[1] - short.shape[1]
    batch = torch.cat([torch.nn.functional.pad(short, (pad, 0)), long])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    padded = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(padded[:1, pad:], logits(model, short), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(padded[1:], logits(model, long), atol=1e-5, rtol=1e-4)

    kwargs = dict(max_new_tokens=2 * SEGMENT, do_sample=False, output_scores=True, return_dict_in_generate=True)
    together = model.generate(batch, attention_mask=mask, pad_token_id=0, **kwargs)
    for row, prompt in enumerate([short, long]):
        alone = model.generate(prompt, pad_token_id=0, **kwargs)
        assert torch.equal(together.sequences[row, batch.shape[1] :], alone.sequences[0, prompt.shape[1] :])
        scores = torch.stack(together.scores)[:, row]
        torch.testing.assert_close(scores, torch.stack(alone.scores)[:, 0], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_padding_free_packed_sequences_are_each_routed_as_if_alone():
    """Sequences packed into one row without padding (position ids restarting at 0, as TRL's `padding_free` packs
    them; transformers' attention masks tell them apart so without an attention mask or a cache): each gets the
    logits it has alone; before, segments ran across the borders (5e-3 apart in float32)."""
    model = soap_model(routing_mode="segment")
    sequences = [token_ids(batch=1, length=n, seed=n) for n in (SEGMENT + 3, 2 * SEGMENT + 5, 5)]
    packed = torch.cat(sequences, dim=1)
    position_ids = torch.cat([torch.arange(s.shape[1]) for s in sequences])[None]
    together = model(packed, position_ids=position_ids, use_cache=False).logits  # as in training
    for sequence, part in zip(sequences, together.split([s.shape[1] for s in sequences], dim=1)):
        torch.testing.assert_close(part, logits(model, sequence), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_bfloat16_prefill_keeps_the_last_segment_past_256_tokens():
    """Token counts are kept in float32: in bfloat16 257 rounds to 256, which would keep the wrong segment's state."""
    model = soap_model(routing_mode="segment").to(torch.bfloat16)
    prompt = token_ids(batch=1, length=32 * SEGMENT + 4)  # 260 tokens: the last segment holds 4
    cache = output_cache(model(prompt, use_cache=True))
    assert all(state.input_count.tolist() == [4.0] for state in cache.soap_routing.values())


# ---------------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.smoke
@torch.no_grad()
def test_prompt_routing_generation_is_the_dense_llama_of_the_merged_weights():
    model = soap_model(routing_mode="prompt")
    prompt = token_ids(batch=1, length=11)
    routed = model(prompt, use_cache=True, output_routing_weights=True).routing_weights
    dense = merged_dense_model(model, tuple(weights[0] for weights in routed))
    kwargs = dict(max_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ours, theirs = model.generate(prompt, **kwargs), dense.generate(prompt, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(theirs.scores), atol=1e-4, rtol=1e-4)


@pytest.mark.smoke
@torch.no_grad()
def test_segment_routing_generation_matches_the_full_forward_across_segments():
    """With the prompt covering segment 0, cached decoding re-routes at every border exactly as training does."""
    model = soap_model(routing_mode="segment")
    prompt = token_ids(batch=2, length=SEGMENT + 2)
    out = model.generate(prompt, max_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True)
    full = model(out.sequences).logits[:, prompt.shape[1] - 1 : -1]
    torch.testing.assert_close(torch.stack(out.scores, dim=1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.smoke
@torch.no_grad()
def test_generate_never_compiles_it_where_it_would_compile_a_static_cache_model():
    """On a GPU `generate` compiles the forward for a static cache whatever `_can_compile_fullgraph` says, and
    SoapMoE's routing breaks the graph (before model code 0.3.4 Dynamo crashed there, in the head's with-block).
    `_compile_all_devices` makes it do the same on this CPU."""
    model = soap_model(routing_mode="segment")
    prompt = token_ids(batch=1, length=SEGMENT + 2)
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True
    kwargs = dict(max_new_tokens=12, do_sample=False)
    static = model.generate(prompt, cache_implementation="static", compile_config=compile_config, **kwargs)
    assert torch.equal(static, model.generate(prompt, **kwargs))
    assert not hasattr(model, "_compiled_call")


@torch.no_grad()
def test_static_cache_generation_keeps_the_padding_out_of_the_routing():
    """For a fixed-size (static) cache `generate` makes 4D masks up front, which say nothing of the padding the SOAP
    segment means leave out: the model keeps the 2D mask instead (`create_masks_for_generate`), so a left-padded
    batch generates with a static cache as with the dynamic one (scores 0.08 apart before model code 0.3.6)."""
    model = soap_model(routing_mode="segment")
    prompt = token_ids(batch=2, length=SEGMENT + 2)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": SEGMENT, "do_sample": False, "pad_token_id": 0}
    kwargs.update(output_scores=True, return_dict_in_generate=True)
    dynamic = model.generate(prompt, **kwargs)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert type(output_cache(static)).__name__ == "StaticCache"
    torch.testing.assert_close(torch.stack(static.scores), torch.stack(dynamic.scores), atol=1e-5, rtol=1e-5)


@pytest.mark.smoke
def test_torch_compile_of_the_model_trains_as_eager():
    """`torch.compile(model)`, what `TrainingArguments(torch_compile=True)` does. SoapMoE's routing breaks the graph
    at its host syncs, and Dynamo failed to resume after a break inside the head's with-block."""
    model = soap_model().train()
    ids = token_ids(batch=2, length=2 * SEGMENT + 3)
    eager = model(ids, labels=ids)
    eager.loss.backward()
    expected = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager")(ids, labels=ids)
    compiled.loss.backward()
    torch.testing.assert_close(compiled.loss, eager.loss)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.smoke
@torch.no_grad()
@pytest.mark.parametrize("routing_mode", ["segment", "prompt"])
def test_beam_search_keeps_each_beams_routing(routing_mode):
    """Every returned beam's score is the log-probability a fresh forward of its own tokens gives: the routing state
    followed the beams across segment borders (prompt routing: each row keeps its prompt's merged FFN)."""
    model = soap_model(routing_mode=routing_mode)
    prompt = token_ids(batch=2, length=SEGMENT + 2)
    kwargs = dict(num_beams=3, num_return_sequences=3, length_penalty=0.0, do_sample=False)
    out = model.generate(
        prompt, max_new_tokens=14, min_new_tokens=14, output_scores=True, return_dict_in_generate=True, **kwargs
    )
    rows = prompt.repeat_interleave(3, dim=0)
    if routing_mode == "prompt":  # a fresh forward routes on all it sees: score the continuation with a cache instead
        prefill = model(rows, use_cache=True)
        rest = model(out.sequences[:, prompt.shape[1] : -1], cache=output_cache(prefill)).logits
        step_logits = torch.cat([prefill.logits[:, -1:], rest], dim=1)
    else:
        step_logits = model(out.sequences).logits[:, prompt.shape[1] - 1 : -1]
    new_tokens = out.sequences[:, prompt.shape[1] :]
    expected = step_logits.log_softmax(-1).gather(-1, new_tokens[..., None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(out.sequences_scores, expected, atol=1e-4, rtol=1e-4)


def test_routing_statistics_come_with_a_forward_pass():
    model = soap_model(num_experts_per_tok=2, utilization_threshold=0.3)
    out = model(token_ids(length=3 * SEGMENT), output_routing_weights=True, output_router_logits=True)
    assert len(out.routing_weights) == len(out.router_logits) == 2
    for weights in out.routing_weights:
        assert weights.shape == (2, 3, 4)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3))
        assert ((weights > 0).sum(-1) == 2).all()  # top-2 merging
    expected = torch.stack([(weights >= 0.3).float().mean() for weights in out.routing_weights])
    torch.testing.assert_close(out.expert_utilization, expected)


# ---------------------------------------------------------------------------------------------------------------
# Files: conversion, saving, remote code
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.smoke
def test_convert_command_upcycles_into_soap_moe_and_saves_remote_code(tmp_path, tiny_dense):
    dense_folder, ids, dense_logits = tiny_dense
    out = tmp_path / "soap"
    argv = ["convert", "--model", str(dense_folder), "--output", str(out), "--no-progress", "--family", "soap_moe"]
    assert main([*argv, "--num-experts", "4", "--segment-length", "16", "--routing-mode", "prompt"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["segment_length"], config["routing_mode"]) == ("soap_moe", 16, "prompt")
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_soap_moe.SoapMoEForCausalLM"
    assert config["auto_map"]["AutoModelForQuestionAnswering"] == "modeling_soap_moe.SoapMoEForQuestionAnswering"
    model = load_moe(out)
    assert isinstance(model, SoapMoEForCausalLM)
    torch.testing.assert_close(logits(model, ids), dense_logits, atol=1e-5, rtol=1e-4)
    module, remote_logits = load_as_remote_code(out, ids[:1])
    assert module.startswith("transformers_modules")
    torch.testing.assert_close(remote_logits, dense_logits[0, -1], atol=1e-5, rtol=1e-4)
    assert main(["info", str(out)]) == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-k", "1"], "--top-k do not apply to --family soap_moe (SoapMoE uses --merge-top-k)"),
        (["--merge-top-k", "9"], "num_experts_per_tok (top-k merging) must be between 1 and num_experts=8"),
        (["--segment-length", "0"], "segment_length must be at least 1"),
        (["--soap-method", "random"], "argument --soap-method/--soap_method: invalid choice: 'random'"),
        (["--router-init", "selector"], "needs a method that splits the FFN's neurons"),
    ],
)
def test_bad_soap_settings_get_one_clear_line(tmp_path, tiny_dense, capsys, flags, message):
    argv = ["convert", "--model", str(tiny_dense[0]), "--output", str(tmp_path / "x"), "--family", "soap_moe"]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x").exists()


def test_save_and_reload_keeps_the_model(tmp_path):
    model = soap_model(num_shared_experts=1, score_scale_factor=0.5)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = token_ids()
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids))


def test_the_experts_kernel_switch_is_not_offered(tmp_path):
    """SOAP runs one merged FFN per segment: asking for a per-token expert kernel is refused, not silently ignored."""
    soap_model().save_pretrained(tmp_path)
    assert not SoapMoEForCausalLM._can_set_experts_implementation()
    SoapMoEForCausalLM.from_pretrained(tmp_path)  # the default loads
    with pytest.raises(ValueError, match="does not support setting experts implementation"):
        SoapMoEForCausalLM.from_pretrained(tmp_path, experts_implementation="grouped_mm")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok (top-k merging) must be between 1 and num_experts=4"),
        ({"segment_length": 0}, "segment_length must be at least 1"),
        ({"routing_mode": "token"}, "Unknown routing_mode 'token'"),
        ({"utilization_threshold": 2.0}, "utilization_threshold must be in [0, 1]"),
        ({"moe_layers": [0, 5]}, "moe_layers must be distinct layers in 0..1"),
    ],
)
def test_impossible_configs_are_refused_clearly(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SoapMoEConfig(**dense_config_fields(tiny_llama_config()), num_experts=4, **fields)


def test_a_model_with_shared_experts_has_no_dense_equivalent():
    with pytest.raises(ValueError, match="shared experts"):
        merged_dense_model(soap_model(num_shared_experts=1), (torch.ones(4) / 4,) * 2)

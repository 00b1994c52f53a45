"""The threaded LM head for CPU decoding (`llama_moe.lm_head`): the same logits and greedy tokens as the plain head
for dense and MoE models, eager (oneDNN) and compiled (a reduction); the parameters, their tying and the state dict
untouched; updates to the weight followed; the plain `F.linear` wherever neither applies (autograd, another dtype)."""

import copy

import pytest
import torch
from helpers import tiny_llama, tiny_moe, token_batch

from llama_moe import build_moe, lm_head
from llama_moe.lm_head import onednn_available, restore_lm_head, use_threaded_linears, use_threaded_lm_head

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("make", [tiny_llama, tiny_moe], ids=["dense", "moe"])
def test_the_threaded_head_gives_the_plain_logits_and_leaves_the_parameters_alone(make):
    model = make(tie_word_embeddings=True) if make is tiny_llama else make()
    ids = token_batch()
    with torch.no_grad():
        plain = model(ids).logits
    keys = list(model.state_dict())
    assert use_threaded_lm_head(model)
    with torch.no_grad():
        fast = model(ids).logits
    head = model.get_output_embeddings()
    assert "_onednn_weight" in head.__dict__  # the fast path ran
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    assert list(model.state_dict()) == keys and isinstance(head.weight, torch.nn.Parameter)
    if model.config.tie_word_embeddings:
        assert head.weight is model.get_input_embeddings().weight
    assert use_threaded_lm_head(model)  # again: nothing changes
    restore_lm_head(model)
    assert "forward" not in head.__dict__ and "_onednn_weight" not in head.__dict__
    head.forward = lambda states: states  # another wrapper (accelerate's hooks) is left alone
    assert not use_threaded_lm_head(model) and head.forward(1) == 1


def test_the_threaded_head_follows_updates_to_the_weight_and_leaves_autograd_to_the_plain_head():
    model = tiny_llama()
    use_threaded_lm_head(model)
    head, states = model.lm_head, torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        head(states)
        head.weight.mul_(2)  # as an optimizer step would
        torch.testing.assert_close(head(states), torch.nn.functional.linear(states, head.weight))
    head.__dict__.pop("_onednn_weight")
    head(states).sum().backward()  # training: autograd through F.linear, no oneDNN copy built
    assert head.weight.grad is not None and "_onednn_weight" not in head.__dict__
    with torch.no_grad():  # compiled: the reduction for one row, F.linear for more; never oneDNN's layout
        compiled = torch.compile(head, fullgraph=True)
        for rows in (states[:1], states):
            torch.testing.assert_close(compiled(rows), torch.nn.functional.linear(rows, head.weight))
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    use_threaded_lm_head(bf16)
    with torch.no_grad():
        bf16.lm_head(states.bfloat16())
    assert "_onednn_weight" not in bf16.lm_head.__dict__


def test_greedy_decoding_of_the_real_model_and_its_split_is_unchanged(smollm2):
    dense, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    for model in (copy.deepcopy(dense), build_moe(dense, num_experts=8, top_k=2)):
        plain = model.generate(**prompt, max_new_tokens=8, do_sample=False)
        use_threaded_lm_head(model)
        assert torch.equal(model.generate(**prompt, max_new_tokens=8, do_sample=False), plain)


def test_threaded_linears_wrap_every_linear_and_run_the_reduction_for_one_row_when_compiled(monkeypatch):
    model = tiny_moe(num_shared_experts=1)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert use_threaded_linears(model) == len(linears) > 1
    assert use_threaded_linears(model) == len(linears)  # again: nothing changes
    ids = token_batch(batch_size=1, length=5)
    with torch.no_grad():
        eager = model(ids).logits
        step = torch.compile(model, fullgraph=True)  # one decoding-sized row per Linear
        torch.testing.assert_close(step(ids[:, :1]).logits, eager[:, :1], atol=1e-5, rtol=1e-5)
    reductions = []
    monkeypatch.setattr(lm_head, "_row_reduction", lambda *args: reductions.append(args) or "reduction")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    linear, states = model.model.layers[0].self_attn.q_proj, torch.randn(2, model.config.hidden_size)
    with torch.no_grad():
        assert linear(states[:1]) == "reduction" and len(reductions) == 1
        torch.testing.assert_close(linear(states), torch.nn.functional.linear(states, linear.weight))  # two rows
    assert linear(states[:1]).requires_grad and len(reductions) == 1  # autograd: F.linear
    restore_lm_head(model)
    assert not any("forward" in module.__dict__ for module in linears)

"""Router gates and losses beyond token-choice top-k: the mutual-information router loss, expert-choice routing with a
capacity factor, and the file permissions of saved checkpoints."""

import copy
import math
import os
import stat

import pytest
import torch
from datasets import Dataset
from helpers import char_tokenizer, tiny_llama_config, tiny_moe, token_batch
from transformers import AutoModelForCausalLM

from llama_moe.source_families import dense_config_fields
from llama_moe_hf import AttnMoEConfig, AttnMoEForCausalLM, LlamaMoEConfig
from llama_moe_hf.modeling.router_losses import router_mi_loss_func

# ----------------------------------------------------------------------------------------------------------------
# Mutual-information router loss


def entropy(probs: list[float]) -> float:
    return -sum(p * math.log(p) for p in probs)


def test_mi_loss_matches_a_hand_computation():
    """Per router: mean token entropy minus the entropy of the mean routing; averaged over the routers."""
    first = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # p = (1/2, 1/2) and (3/4, 1/4)
    second = torch.tensor(
        [[math.log(4.0), 0.0], [0.0, math.log(4.0)], [0.0, 0.0]]
    )  # (4/5, 1/5), (1/5, 4/5), (1/2, 1/2)
    expected_first = (entropy([0.5, 0.5]) + entropy([0.75, 0.25])) / 2 - entropy([0.625, 0.375])
    expected_second = (2 * entropy([0.8, 0.2]) + entropy([0.5, 0.5])) / 3 - entropy([0.5, 0.5])
    torch.testing.assert_close(router_mi_loss_func((first,)).item(), expected_first)
    torch.testing.assert_close(router_mi_loss_func((first, second)).item(), (expected_first + expected_second) / 2)
    assert router_mi_loss_func(()) == 0


def test_mi_loss_spans_minus_log_experts_to_zero():
    """0 for routing that ignores the token; -ln E for confident routing spread evenly over the E experts."""
    assert router_mi_loss_func((torch.zeros(6, 4),)).abs().item() < 1e-7
    confident = 60.0 * torch.eye(4).repeat(2, 1)  # [8, 4]: each expert takes two tokens, all but surely
    torch.testing.assert_close(router_mi_loss_func((confident,)).item(), -math.log(4), atol=1e-6, rtol=0)


def router_logits_of(model) -> list[torch.Tensor]:
    """Filled, on each forward, with the logits of every router of `model` (graph-connected)."""
    found = []
    for module in model.modules():
        if module.__class__.__name__.endswith("Router"):
            module.register_forward_hook(lambda module, args, output: found.append(output[0]))
    return found


def attn_moe(seed: int, **fields) -> AttnMoEForCausalLM:
    """A tiny AttnMoE: 4 attention experts of 2 query heads (top-2) in both layers, dense MLPs."""
    torch.manual_seed(seed)
    config = AttnMoEConfig(**dense_config_fields(tiny_llama_config()), num_attention_experts=4, **fields)
    return AttnMoEForCausalLM(config).eval()


ROUTER_BUILDS = pytest.mark.parametrize(
    "build, gate", [(tiny_moe, "mlp.gate"), (attn_moe, "self_attn.gate")], ids=["llama_moe", "attn_moe_attention"]
)


@ROUTER_BUILDS
@pytest.mark.parametrize("head_computes_loss", [True, False], ids=["in_loss", "attached"])
def test_mi_loss_reaches_the_gradients_whoever_computes_the_loss(build, gate, head_computes_loss):
    """Training with `router_mi_loss_coef=c` gives the gradients of `lm_loss + c * mean over routers of the MI loss`
    written out, which differ from the LM loss's own at the routers: with `labels` the term is in `loss`; without
    (the loss computed from the logits elsewhere, as TRL's fused LM head does) it is attached to the graph."""
    coef, input_ids = 0.5, token_batch()
    with_mi = build(0, router_mi_loss_coef=coef).double().train()
    without_mi = build(0, router_mi_loss_coef=0.0).double().train()

    def lm_loss(model):
        if head_computes_loss:
            return model(input_ids, labels=input_ids).loss
        logits = model(input_ids).logits
        return model.loss_function(logits=logits, labels=input_ids, vocab_size=model.config.vocab_size)

    loss = lm_loss(with_mi)
    loss.backward()
    logits = router_logits_of(without_mi)
    reference = lm_loss(without_mi)
    assert len(logits) == with_mi.config.num_router_layers == 2
    mi_term = coef * router_mi_loss_func(tuple(logits))
    torch.testing.assert_close(loss, reference + mi_term if head_computes_loss else reference)
    gate_weight = without_mi.get_parameter(f"model.layers.0.{gate}.weight")
    lm_only, mi_only = (torch.autograd.grad(term, gate_weight, retain_graph=True)[0] for term in (reference, mi_term))
    (reference + mi_term).backward()
    for (name, param), other in zip(with_mi.named_parameters(), without_mi.parameters()):
        torch.testing.assert_close(param.grad, other.grad, atol=1e-12, rtol=1e-9, msg=name)
    assert mi_only.abs().max() > 1e-6
    assert not torch.allclose(with_mi.get_parameter(f"model.layers.0.{gate}.weight").grad, lm_only)


@ROUTER_BUILDS
def test_router_losses_follow_gradient_accumulation_like_the_lm_loss(build, gate):
    """The z-loss (a mean over tokens, so linear in equal micro-batches) over 2 accumulated micro-batches gives the
    gradients of one batch of both, whichever way the training loop weights the loss: dividing it by the steps, or
    passing `num_items_in_batch` (transformers' Trainer, which then does not divide). Attached to the graph it would
    weigh 2x."""
    model = build(0, router_z_loss_coef=0.1).double().train()
    batch = token_batch(batch_size=4)
    halves = batch[:2], batch[2:]
    num_items = batch[:, 1:].numel()

    def gradients(losses):
        model.zero_grad()
        sum(losses).backward()
        return {name: param.grad.clone() for name, param in model.named_parameters()}

    expected = gradients([model(batch, labels=batch).loss])
    divided = gradients([model(half, labels=half).loss / 2 for half in halves])
    counted = gradients([model(half, labels=half, num_items_in_batch=num_items).loss for half in halves])
    for name, grad in expected.items():  # the routers compute in float32
        torch.testing.assert_close(divided[name], grad, atol=1e-7, rtol=1e-5, msg=name)
        torch.testing.assert_close(counted[name], grad, atol=1e-7, rtol=1e-5, msg=name)
    assert expected[f"model.layers.0.{gate}.weight"].abs().max() > 0


def test_mi_loss_trains_alike_under_sft_trainer_and_trainer(tmp_path):
    """TRL's SFTTrainer bypasses the head's forward; the attached MI term must still give the router gradients of
    the model's own loss (what `Trainer` uses), and they must differ from those without the term."""
    from trl import SFTConfig, SFTTrainer

    texts = ["The quick brown fox jumps over the lazy dog, again and again.", "Sorting lists in place, stably."]
    args = SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_length=40,
        use_cpu=True,
        report_to=[],
        padding_free=False,
    )

    def gradients(model, loss):
        model.zero_grad()
        loss.backward()
        return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}

    def sft_and_own_gradients(coef):
        model = tiny_moe(0, router_mi_loss_coef=coef, output_router_logits=True).train()
        dataset = Dataset.from_dict({"text": texts})
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=char_tokenizer())
        inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        sft = gradients(model, trainer.compute_loss(model, dict(inputs)))
        own = gradients(model, model(**{k: v for k, v in inputs.items() if k != "use_cache"}).loss)
        return sft, own

    sft, own = sft_and_own_gradients(0.5)
    assert sft.keys() == own.keys()
    for name, grad in own.items():
        torch.testing.assert_close(sft[name], grad, atol=2e-6, rtol=1e-4, msg=name)
    sft_without, _ = sft_and_own_gradients(0.0)
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(sft[gate], sft_without[gate], atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Expert-choice routing


def expert_choice_moe(seed: int = 0, **fields):
    return tiny_moe(seed, router_type="expert_choice", **fields)


def routed(model, input_ids) -> list[tuple]:
    """Each MoE layer's router output `(logits, weights, index)` in one forward of `model`."""
    outputs = [layer.mlp.gate for layer in model.model.layers]
    found = []
    hooks = [gate.register_forward_hook(lambda module, args, output: found.append(output)) for gate in outputs]
    model(input_ids)
    for hook in hooks:
        hook.remove()
    return found


@pytest.mark.parametrize(
    "experts, factor, tokens, capacity",
    [
        (4, 1.0, 24, 12),  # ceil(1.0 * 24 * 2 / 4)
        (4, 0.5, 24, 6),
        (4, 1.3, 24, 16),  # 15.6 rounds up
        (4, 2, 24, 24),
        (4, 3.0, 24, 24),  # clipped to the tokens
        (5, 1.1, 25, 11),  # exactly 11: floats would give 11.000000000000002 and 12
    ],
)
def test_each_expert_takes_exactly_capacity_tokens_in_training(experts, factor, tokens, capacity):
    model = expert_choice_moe(num_experts=experts, expert_capacity_factor=factor).train()
    input_ids = token_batch(batch_size=1, length=tokens)
    for logits, weights, index in routed(model, input_ids):
        assert logits.shape == (tokens, experts) and weights.shape == index.shape == (experts, capacity)
        for expert_tokens in index:  # C distinct tokens per expert, the ones it prefers most
            assert expert_tokens.unique().numel() == capacity
        probs = logits.softmax(-1).t()
        torch.testing.assert_close(weights, probs.gather(1, index))
        if capacity < tokens:
            kept_min = weights.min(-1).values
            dropped = probs.scatter(1, index, -1.0).max(-1).values
            assert (kept_min >= dropped).all()


def test_expert_choice_fast_path_equals_the_reference_loop():
    """Training forward in float64 with shared experts and compensation: the default gather/bmm/index_add_ path and
    `experts_implementation="eager"` (a loop over `LlamaMoEExperts.expert`) agree, in outputs and gradients."""
    model = expert_choice_moe(num_shared_experts=1, moe_compensation=True, expert_capacity_factor=1.5)
    for layer in model.model.layers:
        layer.mlp.compensation.data.normal_()
    model = model.double().train()
    reference = copy.deepcopy(model)
    reference.set_experts_implementation("eager")
    assert reference.model.layers[0].mlp.experts.config._experts_implementation == "eager"
    assert model.model.layers[0].mlp.experts.config._experts_implementation != "eager"
    input_ids = token_batch()
    out, ref = model(input_ids, labels=input_ids), reference(input_ids, labels=input_ids)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-10, rtol=1e-10)
    out.loss.backward()
    ref.loss.backward()
    for (name, param), other in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, other.grad, atol=1e-10, rtol=1e-10, msg=name)


def test_expert_choice_output_is_the_weighted_sum_over_the_experts_that_chose_a_token():
    """One block by hand: a token gets `sum_e w_e * expert_e(x)` over the experts that chose it (0 to E of them),
    plus the compensation rows of the others."""
    model = expert_choice_moe(moe_compensation=True, expert_capacity_factor=0.25).double().train()
    block = model.model.layers[0].mlp
    block.compensation.data.normal_()
    states = torch.randn(1, 10, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _, weights, index = block.gate(states.view(-1, 64))  # [4, 2]: C = ceil(0.25 * 10 * 2 / 4)
    assert set(torch.bincount(index.reshape(-1), minlength=10).tolist()) == {0, 1, 2}  # experts per token
    expected = torch.zeros(10, 64, dtype=torch.float64)
    for token in range(10):
        for expert in range(4):
            chosen = (index[expert] == token).nonzero()
            if chosen.numel():
                expert_output = block.experts.expert(states[0, token : token + 1], expert)[0]
                expected[token] += weights[expert, chosen[0, 0]] * expert_output
            else:
                expected[token] += block.compensation[expert]
    torch.testing.assert_close(block(states)[0], expected, atol=1e-12, rtol=1e-12)


def test_expert_choice_trains_the_router_and_the_experts():
    model = expert_choice_moe(router_aux_loss_coef=0.0).train()
    input_ids = token_batch()
    model(input_ids, labels=input_ids).loss.backward()
    for layer in model.model.layers:
        for param in (layer.mlp.gate.weight, layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            assert param.grad is not None and param.grad.abs().sum() > 0


def test_expert_choice_routes_token_choice_top_k_outside_training():
    """Evaluation and generation: the same logits routed like `router_type="top_k"` (a KV cache works)."""
    model = expert_choice_moe(seed=3)
    top_k = tiny_moe(seed=4, router_type="top_k")
    top_k.load_state_dict(model.state_dict())
    input_ids = token_batch()
    logits, weights, index = routed(model, input_ids)[0]
    assert weights.shape == index.shape == (input_ids.numel(), 2)
    torch.testing.assert_close(model(input_ids).logits, top_k(input_ids).logits, atol=0, rtol=0)
    prompt = input_ids[:1, :6]
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 12)
    assert torch.equal(generated, top_k.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("factor", [0.0, -1.0])
def test_config_refuses_a_capacity_factor_that_is_not_positive(factor):
    with pytest.raises(ValueError, match="expert_capacity_factor must be > 0"):
        LlamaMoEConfig(**dense_config_fields(tiny_llama_config()), expert_capacity_factor=factor)


def test_config_refuses_a_negative_mi_loss_coefficient():
    with pytest.raises(ValueError, match="router_mi_loss_coef"):
        LlamaMoEConfig(**dense_config_fields(tiny_llama_config()), router_mi_loss_coef=-0.1)


def test_attention_experts_refuse_expert_choice():
    with pytest.raises(ValueError, match="attention_router_type='expert_choice' is not supported"):
        AttnMoEConfig(**dense_config_fields(tiny_llama_config()), attention_router_type="expert_choice")
    # An MLP with expert choice leaves the attention routers token-choice.
    config = AttnMoEConfig(**dense_config_fields(tiny_llama_config()), router_type="expert_choice", moe_layers=[0])
    assert config.attention_router_type == "top_k"


def test_save_and_reload_keep_expert_choice_and_its_capacity(tmp_path):
    model = expert_choice_moe(expert_capacity_factor=1.25)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.config.router_type == "expert_choice" and loaded.config.expert_capacity_factor == 1.25
    input_ids = token_batch()
    model.train(), loaded.train()
    assert routed(loaded, input_ids)[0][2].shape == (4, 15)  # ceil(1.25 * 24 * 2 / 4)
    torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# File permissions


def test_saved_files_get_the_mode_the_umask_gives(tmp_path):
    """safetensors writes the weights through a 0600 temporary file; `save_pretrained` gives every file it wrote
    0o666 & ~umask, and leaves the other files of the folder alone."""
    private = tmp_path / "private.txt"
    private.write_text("not written by save_pretrained")
    private.chmod(0o600)
    old_umask = os.umask(0o022)
    try:
        tiny_moe().save_pretrained(tmp_path, max_shard_size="100KB")  # sharded: an index file too
    finally:
        os.umask(old_umask)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in tmp_path.iterdir()}
    assert "model.safetensors.index.json" in modes and len([n for n in modes if n.endswith(".safetensors")]) > 1
    assert modes.pop("private.txt") == 0o600
    assert modes == dict.fromkeys(modes, 0o644)

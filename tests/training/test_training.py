"""Training LlamaMoE with the Hugging Face stack: PEFT LoRA on the fused experts, Trainer, TRL's SFTTrainer with the
router losses, and two-process CPU DDP. Models are the real SmolLM2 cut to a few layers and split into experts,
trained on real text."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import FAMILY_FIELDS, char_tokenizer, tiny_family_model, tiny_llama
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaForCausalLM, Trainer, TrainingArguments
from transformers.initialization import no_init_weights

from llama_moe.training.freezing import train_moe_only
from llama_moe_hf import LlamaMoEForCausalLM, build_moe

pytestmark = pytest.mark.slow

SEQ_LEN = 48


def small_smollm2_moe(smollm2, num_layers: int = 2, **moe_fields) -> LlamaMoEForCausalLM:
    """The first `num_layers` layers of SmolLM2 with each FFN split into 8 random experts, top-2, seeded router."""
    dense, _ = smollm2
    config = copy.deepcopy(dense.config)
    config.num_hidden_layers = num_layers
    with no_init_weights():
        small = LlamaForCausalLM(config)
    small.load_state_dict(dense.state_dict(), strict=False)  # the deeper layers' keys are simply not used
    small.tie_weights()
    moe = build_moe(small, num_experts=8, top_k=2)
    for name, value in moe_fields.items():
        setattr(moe.config, name, value)
    return moe


@pytest.fixture(scope="module")
def text_chunks(smollm2, real_text) -> torch.Tensor:
    """[8, SEQ_LEN] token ids of consecutive real text."""
    _, tokenizer = smollm2
    ids = tokenizer("\n\n".join(real_text[:40]), return_tensors="pt").input_ids[0]
    return ids[: 8 * SEQ_LEN].view(8, SEQ_LEN)


@torch.no_grad()
def lm_loss(model, input_ids) -> float:
    return model(input_ids, labels=input_ids).loss.item()


def test_lora_on_fused_experts_trains_saves_reloads_and_merges(smollm2, text_chunks, tmp_path):
    lora_config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = get_peft_model(small_smollm2_moe(smollm2), lora_config)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any("experts" in name and "lora" in name for name in trainable)
    assert all("lora" in name for name in trainable)

    batch = text_chunks[:2]
    before = lm_loss(model, batch)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    for _ in range(4):
        optimizer.zero_grad()
        model(batch, labels=batch).loss.backward()
        optimizer.step()
    model.eval()
    after = lm_loss(model, batch)
    assert after < before - 0.3, (before, after)

    with torch.no_grad():
        trained_logits = model(batch).logits
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(small_smollm2_moe(smollm2), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch).logits, trained_logits, atol=1e-5, rtol=1e-5)
        merged = reloaded.merge_and_unload()
        assert type(merged) is LlamaMoEForCausalLM
        # Merged weights round differently from base + adapter: 1.2e-4 apart seen (one logit of 4.7M, when
        # tests/package/test_structure.py ran first in the same process).
        torch.testing.assert_close(merged(batch).logits, trained_logits, atol=5e-4, rtol=1e-4)


def test_trainer_lowers_the_loss_on_real_text(smollm2, text_chunks, tmp_path):
    model = small_smollm2_moe(smollm2, output_router_logits=True)
    model.model.embed_tokens.weight.requires_grad_(False)  # the tied 49k-vocab matrix dominates the step time
    dataset = Dataset.from_dict({"input_ids": text_chunks.tolist(), "labels": text_chunks.tolist()})
    before = lm_loss(model, text_chunks)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=2e-4,
        lr_scheduler_type="constant",
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=dataset).train()
    after = lm_loss(model.eval(), text_chunks)
    assert after < before - 0.2, (before, after)


def test_sft_trainer_adds_the_router_aux_loss(smollm2, real_text, tmp_path):
    from trl import SFTConfig, SFTTrainer

    _, tokenizer = smollm2
    model = small_smollm2_moe(smollm2, num_layers=1)
    dataset = Dataset.from_dict({"text": real_text[:8]})
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        max_length=SEQ_LEN,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    assert trainer.aux_loss_enabled and model.config.output_router_logits
    trainer.train()
    aux = [log["aux_loss"] for log in trainer.state.log_history if "aux_loss" in log]
    assert len(aux) == 2 and all(value > 0 for value in aux)


def test_every_router_loss_trains_alike_under_sft_trainer_and_trainer(tmp_path):
    """AttnMoE with an MLP MoE and a z-loss: SFTTrainer's fused head adds the balance loss of `router_logits` (the MLP
    routers) itself; the attention routers' balance loss and the z-loss are in the graph. Every gradient must equal
    the one of the model's own loss, which `Trainer` uses."""
    from trl import SFTConfig, SFTTrainer

    model = build_moe(
        tiny_llama(), family="attn_moe", attn_experts=4, attn_top_k=2, mlp_moe=True, num_experts=4
    ).train()
    model.config.router_z_loss_coef, model.config.router_aux_loss_coef = 0.5, 0.1
    for layer in model.model.layers:  # the z-loss weight is read when the model is built
        layer.mlp.z_loss_weight = layer.self_attn.z_loss_weight = 0.5 / model.config.num_router_layers
    texts = ["The quick brown fox jumps over the lazy dog, again and again.", "Sorting lists in place, stably."]
    args = SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_length=40,
        use_cpu=True,
        report_to=[],
        padding_free=False,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}), processing_class=char_tokenizer()
    )
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))

    def gradients(loss):
        model.zero_grad()
        loss.backward()
        return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}

    sft = gradients(trainer.compute_loss(model, dict(inputs)))
    own = gradients(model(**{k: v for k, v in inputs.items() if k != "use_cache"}).loss)
    assert sft.keys() == own.keys() and "model.layers.0.self_attn.gate.weight" in own
    for name, grad in own.items():
        torch.testing.assert_close(sft[name], grad, atol=2e-6, rtol=1e-4, msg=name)


def test_two_process_cpu_ddp_keeps_ranks_identical(tmp_path):
    script = Path(__file__).parents[1] / "scripts" / "ddp_train_script.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(script), str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]

    initial = load_file(tmp_path / "initial.safetensors")
    ranks = [load_file(tmp_path / f"rank{rank}.safetensors") for rank in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() == initial.keys()
    for name in initial:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"):
        assert not torch.equal(ranks[0][name], initial[name]), name


@pytest.mark.parametrize("family", sorted(FAMILY_FIELDS))
def test_train_moe_only_trains_exactly_the_moe_blocks(family):
    model = tiny_family_model(family)
    moe_parts = (".mlp.", ".self_attn.") if family == "attn_moe" else (".mlp.",)  # every layer is converted
    expected = {name for name, _ in model.named_parameters() if any(part in name for part in moe_parts)}
    trained = train_moe_only(model)
    assert {name for name, parameter in model.named_parameters() if parameter.requires_grad} == expected
    assert trained == sum(parameter.numel() for name, parameter in model.named_parameters() if name in expected)
    with pytest.raises(ValueError, match="has no MoE blocks"):
        train_moe_only(tiny_llama())

"""Distillation from a dense teacher: the KL term of continual pre-training (router gradients, the teacher left
untouched, top-k), the teacher resolved from the student's recipe, the recipes end to end on a tiny teacher/student
pair, and SFT under TRL's distillation trainers with the router balance loss kept."""

import json
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from helpers import (
    CHAT_TEMPLATE,
    RECIPES,
    char_tokenizer,
    one_error_line,
    run_recipe,
    save_tiny_dense,
    tiny_llama,
    tiny_moe,
    token_batch,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from llama_moe.distillation import distillation_kl
from llama_moe.loading import DEFAULT_MODEL
from llama_moe.training.checkpoint import HISTORY_FILE
from llama_moe.training.distill import (
    DistillationMixin,
    Distiller,
    load_teacher,
    recorded_source,
    resolve_teacher,
)
from llama_moe.training.pretrain import ContinualPretrainArguments
from llama_moe_hf import convert_to_moe

pytestmark = pytest.mark.slow


class Distilling(DistillationMixin, Trainer):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(dense teacher folder, MoE student folder converted from it): character tokenizer with a chat template, the
    student's moe_recipe.yaml naming the teacher's folder. Tests must not modify them."""
    root = tmp_path_factory.mktemp("pair")
    save_tiny_dense(root / "dense")
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "dense")
    convert_to_moe(root / "dense", root / "moe", method="random", num_experts=4, top_k=2, progress=False)
    return root / "dense", root / "moe"


def _sharp_teacher(seed: int = 1):
    """A tiny dense model whose next-token distributions are far from uniform (a random head is nearly uniform)."""
    teacher = tiny_llama(seed)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(30)
    return teacher.requires_grad_(False)


def _args(tmp_path, **overrides) -> TrainingArguments:
    fields = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none", "disable_tqdm": True}
    return TrainingArguments(**(fields | {"save_strategy": "no"} | overrides))


def test_top_k_kl_is_the_full_kl_at_k_equal_vocabulary_and_a_lower_bound_below(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    teacher = 4 * torch.randn(3, 5, 50, generator=generator)
    student = (2 * torch.randn(3, 5, 50, generator=generator)).requires_grad_()

    def value_and_grad(top_k):
        kl = distillation_kl(student, teacher, temperature=2.0, top_k=top_k)
        (grad,) = torch.autograd.grad(kl.sum(), student)
        return kl.detach(), grad

    full, full_grad = value_and_grad(None)
    reference = F.kl_div(
        F.log_softmax(student / 2, -1), F.log_softmax(teacher / 2, -1), reduction="none", log_target=True
    )
    torch.testing.assert_close(full, reference.sum(-1).detach())
    every, every_grad = value_and_grad(50)
    torch.testing.assert_close(every, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(every_grad, full_grad, atol=1e-5, rtol=1e-5)
    few, _ = value_and_grad(5)
    assert (few <= full + 1e-6).all() and (few > 0).all()  # the bucket keeps the student's misplaced mass costly


def test_router_gradients_are_the_model_loss_plus_the_distillation_terms(tmp_path):
    """Under the distillation trainer every gradient, the routers' included, is that of the model's own loss (LM +
    balance loss, z-loss in the graph) weighted (1 - alpha), plus alpha (balance + T^2 KL) and the hidden term."""
    student = tiny_moe(router_aux_loss_coef=0.05, router_z_loss_coef=0.1, output_router_logits=True).train()
    teacher = _sharp_teacher()
    alpha, temperature, weight = 0.7, 2.0, 0.3
    distiller = Distiller(teacher, alpha, temperature, hidden_layers=(1,), hidden_weight=weight, hidden_loss="mse")
    trainer = Distilling(model=student, args=_args(tmp_path), distiller=distiller)
    ids = token_batch(2, 12)

    def gradients(loss):
        student.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}

    ours = gradients(trainer.compute_loss(student, {"input_ids": ids, "labels": ids}, num_items_in_batch=22))
    outputs = student(ids, labels=ids, output_hidden_states=True)  # loss = LM + 0.05 * balance
    with torch.no_grad():
        taught = teacher(ids, output_hidden_states=True)
    log_student = F.log_softmax(outputs.logits[:, :-1] / temperature, -1)
    log_teacher = F.log_softmax(taught.logits[:, :-1] / temperature, -1)
    kl = F.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True) / 11  # per token
    mse = (outputs.hidden_states[1] - taught.hidden_states[1])[:, :-1].square().mean()
    router = 0.05 * outputs.aux_loss
    manual = gradients((1 - alpha) * outputs.loss + alpha * (router + temperature**2 * kl) + weight * mse)
    assert ours.keys() == manual.keys() and "model.layers.0.mlp.gate.weight" in ours
    for name, grad in manual.items():
        torch.testing.assert_close(ours[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert kl > 0.1 and mse > 0


def test_teacher_is_never_trained_or_changed(pair, tmp_path):
    dense, moe = pair
    teacher = load_teacher(str(dense))
    before = {name: tensor.clone() for name, tensor in teacher.state_dict().items()}
    student = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    student_before = student.model.layers[0].mlp.gate.weight.clone()
    blocks = token_batch(8, 16).tolist()
    trainer = Distilling(
        model=student,
        args=_args(tmp_path, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2),
        train_dataset=Dataset.from_dict({"input_ids": blocks, "labels": blocks}),
        distiller=Distiller(teacher, alpha=1.0, hidden_layers=(-1,), hidden_weight=1.0),
    )
    trainer.train()
    assert not teacher.training and all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    assert all(torch.equal(before[name], tensor) for name, tensor in teacher.state_dict().items())
    assert not torch.equal(student.model.layers[0].mlp.gate.weight, student_before)  # the routers did train
    assert all(
        "distill_kl" in line and "distill_hidden" in line for line in trainer.state.log_history if "loss" in line
    )


def test_the_default_teacher_is_the_source_the_student_records(pair, tmp_path):
    dense, moe = pair
    assert recorded_source(str(moe)) == str(dense.resolve())  # moe_recipe.yaml's `model`
    assert resolve_teacher(str(moe), None) == str(dense.resolve())
    assert resolve_teacher(str(moe), "org/teacher") == "org/teacher"
    assert resolve_teacher(str(moe), "none") is None and resolve_teacher(str(moe), "") is None

    built_in = tmp_path / "built-in"  # converted from the built-in default: `model: null`
    built_in.mkdir()
    (built_in / "config.json").write_text((moe / "config.json").read_text())
    recipe = (moe / "moe_recipe.yaml").read_text().replace(f"model: {dense.resolve()}", "model: null")
    (built_in / "moe_recipe.yaml").write_text(recipe)
    assert recorded_source(str(built_in)) == DEFAULT_MODEL

    (built_in / "moe_recipe.yaml").unlink()  # no recipe: the config's conversion_info names the source
    config = json.loads((moe / "config.json").read_text())
    config["conversion_info"]["source"] = "HuggingFaceTB/SmolLM2-135M-Instruct (built-in default: Q4_1 GGUF ...)"
    (built_in / "config.json").write_text(json.dumps(config))
    assert recorded_source(str(built_in)) == DEFAULT_MODEL
    del config["conversion_info"]
    (built_in / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not record the dense model"):
        recorded_source(str(built_in))


def _domain_files(tmp_path: Path, real_text) -> tuple[str, str]:
    """(training, held-out) JSON lines of real prose."""
    paths = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    for path, texts in zip(paths, (real_text[:50], real_text[50:60])):
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(paths[0]), str(paths[1])


def _distill_recipe(moe: Path, tmp_path: Path, real_text, *flags: str, config: str = "pretrain/distill.yaml"):
    """Three steps of a continual pre-training recipe (distill.yaml) on real prose into tmp_path/out; its outcome."""
    train, test = _domain_files(tmp_path, real_text)
    argv = ["--config", str(RECIPES / config), "--model_name_or_path", str(moe)]
    argv += ["--output_dir", str(tmp_path / "out"), "--domains", f"prose={train}", "--domain_weights", "prose=1"]
    argv += ["--held_out", f"prose={test}", "--seq_len", "32", "--eval_blocks", "2", "--max_steps", "3"]
    argv += ["--warmup_steps", "1", "--eval_steps", "3", "--logging_steps", "1", "--disable_tqdm", "true"]
    argv += ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--use_cpu", "true"]
    return runpy.run_path(str(RECIPES / "continual_pretrain.py"))["main"](argv + list(flags))


def test_continual_pretraining_recipe_distils_and_records_the_teacher(pair, tmp_path, real_text):
    dense, moe = pair
    outcome = _distill_recipe(moe, tmp_path, real_text, "--distill_top_k", "16")

    (stage,) = json.loads((outcome.output / HISTORY_FILE).read_text())
    assert stage["steps"] == 3 and stage["tokens"] == 3 * 4 * 32 and stage["trained"] == "all"
    assert stage["distillation"] == {"teacher": "dense", "alpha": 0.5, "temperature": 1.0, "top_k": 16}
    card = (outcome.output / "README.md").read_text()
    assert "Stage 1 distilled from `dense` (alpha 0.5, temperature 1.0, top_k 16)." in card
    assert str(tmp_path) not in card
    names = {path.name for path in outcome.output.iterdir()}
    assert {"model.safetensors", "config.json", "modeling_llama_moe.py", "tokenizer.json", "moe_recipe.yaml"} <= names
    assert all("distill_kl" in line for line in outcome.log_history if "loss" in line)
    reloaded = AutoModelForCausalLM.from_pretrained(outcome.output, dtype=torch.float32).eval()
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, outcome.model.eval()(ids).logits)
    # The carried recipe makes the trained folder name the same default teacher for a next stage.
    assert recorded_source(str(outcome.output)) == str(dense.resolve())


def test_a_corrected_teacher_is_the_dense_source_trained_on_the_lm_loss_and_then_teaches(pair, tmp_path, real_text):
    dense, moe = pair
    (tmp_path / "correction").mkdir()
    (tmp_path / "student").mkdir()
    corrected = _distill_recipe(dense, tmp_path / "correction", real_text, config="pretrain/teacher_correction.yaml")

    (stage,) = json.loads((corrected.output / HISTORY_FILE).read_text())
    assert stage["distillation"] is None and stage["started_from"] == "dense" and stage["trained"] == "all"
    assert json.loads((corrected.output / "config.json").read_text())["model_type"] == "llama"
    before, after = load_file(dense / "model.safetensors"), load_file(corrected.output / "model.safetensors")
    assert before.keys() == after.keys() and not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    # The corrected folder teaches in place of the source the student records.
    flags = ["--teacher_model_name_or_path", str(corrected.output)]
    student = _distill_recipe(moe, tmp_path / "student", real_text, *flags)
    (stage,) = json.loads((student.output / HISTORY_FILE).read_text())
    assert stage["distillation"]["teacher"] == "out"
    assert all("distill_kl" in line for line in student.log_history if "loss" in line)


def test_default_names_the_built_in_dense_model_for_continual_pretraining(smollm2_path):
    args = ContinualPretrainArguments(model_name_or_path="default", domains=["prose=x.jsonl"])
    assert Path(args.model_name_or_path) == smollm2_path


def test_train_moe_only_keeps_every_other_weight_as_converted(pair, tmp_path, real_text):
    _, moe = pair
    outcome = _distill_recipe(moe, tmp_path, real_text, "--train_moe_only", "true")

    (stage,) = json.loads((outcome.output / HISTORY_FILE).read_text())
    assert stage["trained"] == "moe-blocks"
    before, after = load_file(moe / "model.safetensors"), load_file(outcome.output / "model.safetensors")
    assert before.keys() == after.keys()
    moe_keys = {key for key in before if ".mlp." in key}
    assert moe_keys and all(torch.equal(before[key], after[key]) for key in before.keys() - moe_keys)
    assert all(not torch.equal(before[key], after[key]) for key in moe_keys if key.endswith(("_proj", "gate.weight")))


def test_train_moe_only_on_a_dense_model_is_one_error_line_before_it_loads(pair, tmp_path, capsys, monkeypatch):
    dense, _ = pair

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", loaded)
    argv = ["--config", str(RECIPES / "pretrain/distill.yaml"), "--model_name_or_path", str(dense)]
    argv += ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--train_moe_only", "true"]
    argv += ["--teacher_model_name_or_path", "none"]
    assert run_recipe("continual_pretrain.py", argv) == 2
    assert "train_moe_only: " in one_error_line(capsys) and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "script, config",
    [
        ("continual_pretrain.py", "pretrain/distill.yaml"),
        ("sft.py", "sft/stage1-general-distill.yaml"),
        ("sft.py", "sft/stage2-math-code-distill.yaml"),
    ],
)
def test_a_teacher_with_another_vocabulary_is_one_error_line(pair, tmp_path, capsys, monkeypatch, script, config):
    _, moe = pair
    tiny_llama(vocab_size=130).save_pretrained(tmp_path / "teacher")
    capsys.readouterr()  # the save's progress bar

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", loaded)
    argv = ["--config", str(RECIPES / config), "--model_name_or_path", str(moe), "--use_cpu", "true"]
    argv += ["--output_dir", str(tmp_path / "out"), "--teacher_model_name_or_path", str(tmp_path / "teacher")]
    assert run_recipe(script, argv) == 2
    assert "has a vocabulary of 130 tokens and the student" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def _sft_stage(pair, tmp_path: Path, distill: str, **settings):
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig
    from trl.scripts.utils import DatasetConfig

    from llama_moe.training.sft import MoESFTArguments

    chats = [
        {
            "prompt": [{"role": "user", "content": f"say alpha {i}"}],
            "completion": [{"role": "assistant", "content": f"alpha alpha {i % 10}"}],
        }
        for i in range(16)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in chats))
    training = SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_length=64,
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        router_aux_loss_coef=0.1,
    )
    return (
        ScriptArguments(),
        training,
        ModelConfig(model_name_or_path=str(pair[1])),
        DatasetMixtureConfig(datasets=[DatasetConfig(path="json", data_files=str(data))]),
        MoESFTArguments(distill=distill, max_new_tokens=6, **settings),
    )


@pytest.mark.parametrize("distill, settings", [("gkd", {"lmbda": 0.5}), ("on_policy", {"beta": 0.5})])
def test_sft_distillation_runs_under_trl_with_the_router_balance_loss(pair, tmp_path, distill, settings):
    from llama_moe.training.sft import build_sft_trainer, run_sft

    stage = _sft_stage(pair, tmp_path, distill, **settings)
    trainer, _ = build_sft_trainer(*stage)
    _assert_balance_loss_in_the_gradients(trainer)

    outcome = run_sft(*stage)
    (record,) = json.loads((outcome.output / HISTORY_FILE).read_text())
    assert record["steps"] == 2 and record["distillation"]["method"] == distill
    assert record["distillation"]["teacher"] == "dense" and record["distillation"]["max_new_tokens"] == 6
    assert all(record["distillation"][name] == value for name, value in settings.items())
    assert f"Stage 1 distilled from `dense` (method {distill}," in (outcome.output / "README.md").read_text()
    assert all(line["aux_loss"] > 0 for line in outcome.log_history if "loss" in line)
    assert outcome.model.config.output_router_logits is False  # saved as loaded


def _assert_balance_loss_in_the_gradients(trainer):
    """The trainer's loss minus TRL's own is 0.1 * the balance loss of the same forward, in value and in the routers'
    gradients."""
    from trl import DistillationTrainer
    from trl.experimental.gkd import GKDTrainer

    model = trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    if isinstance(trainer, GKDTrainer):
        ours, base = trainer.compute_loss(model, dict(inputs)), GKDTrainer.compute_loss(trainer, model, dict(inputs))
        aux = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).aux_loss
    else:
        ours = trainer._compute_loss(model, inputs, None)[0]
        base = DistillationTrainer._compute_loss(trainer, model, inputs, None)[0]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        aux = model.router_aux_loss(model.model(input_ids=ids, attention_mask=mask, output_router_logits=True), mask)
    gate = model.model.layers[0].mlp.gate.weight
    (ours_grad,) = torch.autograd.grad(ours, gate)
    (manual_grad,) = torch.autograd.grad(base + 0.1 * aux, gate)
    torch.testing.assert_close(ours.detach(), (base + 0.1 * aux).detach())
    torch.testing.assert_close(ours_grad, manual_grad)
    assert aux > 0

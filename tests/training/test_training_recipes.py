"""The training recipes end to end on a tiny LlamaMoE and tiny local data: continual pre-training on a domain mixture
(static and dynamic sampling) and two-stage SFT with replay; each output is a complete checkpoint that reloads with
the trained model's logits."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_as_remote_code, logits, token_batch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments
from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser
from trl.scripts.utils import DatasetConfig

from llama_moe.training.checkpoint import HISTORY_FILE
from llama_moe.training.mixture import (
    DomainData,
    DomainMixture,
    DomainWeights,
    load_domain,
    resolve_weights,
    sheared_llama_update,
)
from llama_moe.training.offline_data import OfflineDataOptions, build_offline_data
from llama_moe.training.pretrain import ContinualPretrainArguments, continual_pretrain
from llama_moe.training.sampling import domain_losses
from llama_moe.training.sft import MoESFTArguments, build_sft_trainer, run_sft

RECIPES = Path(__file__).parents[2] / "recipes"


@pytest.fixture
def umask_022():
    """A fixed umask, so that normal file permissions are 0o644."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _training_args(output: Path, **overrides) -> TrainingArguments:
    fields = dict(
        output_dir=str(output),
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**(fields | overrides))


def _assert_complete_checkpoint(folder: Path, model, stages: int, remote: bool = True) -> list[dict]:
    """Weights (mode 0o644 under umask 022), config, remote code, tokenizer, card and history; no pickle; the same
    logits as the trained model, also as remote code without the package (`remote`: a fresh process, ~10 s, so
    once per way of saving: pre-training, SFT's second stage, LoRA's merge)."""
    names = {path.name for path in folder.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_llama_moe.py", "tokenizer.json", "README.md"} <= names
    assert "training_args.bin" not in names and not any(name.startswith(".") for name in names)
    assert all(path.stat().st_mode & 0o777 == 0o644 for path in folder.iterdir() if path.is_file())
    ids = token_batch()
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(reloaded, ids), logits(model.eval(), ids), atol=1e-5, rtol=1e-5)
    if remote:
        module, remote_logits = load_as_remote_code(folder, ids)
        assert module.startswith("transformers_modules")
        torch.testing.assert_close(remote_logits, logits(model, ids)[0, -1], atol=1e-4, rtol=1e-4)
    history = json.loads((folder / HISTORY_FILE).read_text())
    assert len(history) == stages
    card = (folder / "README.md").read_text()
    assert all(f"| {number} | {stage['recipe']} |" in card for number, stage in enumerate(history, 1))
    assert str(folder.parent) not in card  # no local paths in a card that may be published
    return history


def test_continual_pretraining_lowers_held_out_loss_and_saves_a_complete_checkpoint(
    tiny_moe_path, domains, tmp_path, umask_022
):
    args = ContinualPretrainArguments(
        model_name_or_path=str(tiny_moe_path),
        domains=[f"{name}={path}" for name, path in domains.items()],
        domain_weights=["prose=0.7", "code=0.3"],
        seq_len=64,
        held_out_fraction=0.1,
        eval_blocks=8,
    )
    outcome = continual_pretrain(args, _training_args(tmp_path / "out", max_steps=40))

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_path)
    held_out = [load_domain(n, p, tokenizer, 64, 0.1).held_out[:8] for n, p in domains.items()]
    before = domain_losses(AutoModelForCausalLM.from_pretrained(tiny_moe_path), held_out)
    after = [outcome.metrics["prose_loss"], outcome.metrics["code_loss"]]
    assert all(b - a > 0.5 for b, a in zip(before, after)), (before, after)
    np.testing.assert_allclose(domain_losses(outcome.model, held_out), after, atol=1e-3)

    (stage,) = _assert_complete_checkpoint(outcome.output, outcome.model, stages=1)
    assert stage["steps"] == 40 and stage["tokens"] == 40 * 8 * 64 and stage["sampling"] == "static"
    assert abs(stage["data"]["prose"] - 0.7) < 0.08  # 320 blocks drawn with weights 0.7 / 0.3
    assert outcome.model.config.output_router_logits is False  # trained with the balance loss, saved as loaded


def test_sheared_llama_update_moves_weight_to_the_domain_above_its_reference():
    weights = np.array([0.5, 0.5])
    updated = sheared_llama_update(weights, losses=[3.0, 2.5], reference=[2.0, 2.5], step_size=1.0, smoothing=0.0)
    np.testing.assert_allclose(updated, np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum())
    below = sheared_llama_update(weights, losses=[1.0, 1.0], reference=[2.0, 2.0], smoothing=0.0)
    np.testing.assert_allclose(below, weights)  # no excess anywhere: nothing moves
    smoothed = sheared_llama_update(np.array([1.0 - 1e-12, 1e-12]), [9.0, 0.0], [0.0, 0.0], smoothing=0.1)
    assert smoothed[1] >= 0.05  # the smoothing keeps every domain sampled


def test_the_block_stream_does_not_depend_on_the_batch_size():
    """What teacher correction relies on (docs/training.md): with the same seed and mix, a run in batches of 2 trains
    on exactly the blocks, in the same order, of a run in batches of 4 with half the steps."""
    blocks = torch.arange(3 * 10 * 4).reshape(3, 10, 4)  # 3 domains of 10 blocks of 4 tokens, every block distinct
    domains = [DomainData(name, train, train[:1]) for name, train in zip("abc", blocks)]

    def trained_blocks(batch_size: int, steps: int) -> torch.Tensor:
        mixture = DomainMixture(domains, DomainWeights(list("abc"), np.array([0.25, 0.25, 0.5])), seed=3)
        loader = iter(DataLoader(mixture, batch_size=batch_size))
        return torch.cat([next(loader)["input_ids"] for _ in range(steps)])

    in_fours = trained_blocks(4, 12)  # 48 draws from domains of 10 blocks: passes and reshuffles included
    assert torch.equal(trained_blocks(2, 24), in_fours) and torch.equal(trained_blocks(1, 48), in_fours)
    assert len({tuple(block.tolist()) for block in in_fours}) > 10  # blocks of several domains, not one repeated


def test_dynamic_sampling_raises_the_weight_of_the_domain_with_more_excess_loss(tiny_moe_path, tmp_path):
    """`easy` is one repeated sentence (learned within a few steps), `hard` random characters: with the same reference
    loss, `hard` keeps the larger excess and its weight rises from 0.5."""
    rng = np.random.default_rng(0)
    easy = [{"text": "the cat sat on the mat. " * 20} for _ in range(60)]
    hard = [{"text": "".join(chr(c) for c in rng.integers(33, 127, 480))} for _ in range(60)]
    args = ContinualPretrainArguments(
        model_name_or_path=str(tiny_moe_path),
        domains=[
            f"easy={_write_jsonl(tmp_path / 'easy.jsonl', easy)}",
            f"hard={_write_jsonl(tmp_path / 'h.jsonl', hard)}",
        ],
        sampling="dynamic",
        reference_losses=["easy=1.0", "hard=1.0"],
        update_steps=5,
        seq_len=64,
        eval_blocks=4,
    )
    outcome = continual_pretrain(args, _training_args(tmp_path / "out", max_steps=30))
    (stage,) = json.loads((outcome.output / HISTORY_FILE).read_text())
    assert stage["final_domain_weights"]["hard"] > 0.7, stage["final_domain_weights"]
    assert stage["data"]["hard"] > stage["data"]["easy"]


def test_domain_options_fail_with_one_clear_error(tiny_moe_path, domains, tmp_path):
    with pytest.raises(ValueError, match="missing \\['code'\\]"):
        resolve_weights(["prose=1"], ["prose", "code"])
    with pytest.raises(ValueError, match="Unknown domain weights preset"):
        resolve_weights("slimpajama", ["prose"])
    args = ContinualPretrainArguments(
        model_name_or_path=str(tiny_moe_path), domains=[f"prose={domains['prose']}"], sampling="dynamic", seq_len=64
    )
    with pytest.raises(ValueError, match="needs reference losses"):
        continual_pretrain(args, _training_args(tmp_path / "out", max_steps=1))
    assert not (tmp_path / "out" / "model.safetensors").exists()


def _chats(marker: str, count: int) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"say {marker} {i}"}],
            "completion": [{"role": "assistant", "content": f"{marker} {marker} {i % 10}"}],
        }
        for i in range(count)
    ]


def _sft_args(output: Path, **overrides) -> SFTConfig:
    fields = dict(
        output_dir=str(output),
        max_length=64,
        packing=True,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=0.03,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": 3e-4},
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return SFTConfig(**(fields | overrides))


def _mixture(**files_and_fractions) -> DatasetMixtureConfig:
    configs = [DatasetConfig(path="json", data_files=f, fraction=fr) for f, fr in files_and_fractions.values()]
    return DatasetMixtureConfig(datasets=configs)


def test_two_stage_sft_with_replay_and_frozen_routers(tiny_moe_path, tmp_path, umask_022):
    one = _write_jsonl(tmp_path / "one.jsonl", _chats("alpha", 200))
    two = _write_jsonl(tmp_path / "two.jsonl", _chats("beta", 200))

    stage1 = run_sft(
        ScriptArguments(),
        _sft_args(tmp_path / "stage1", max_steps=12),
        ModelConfig(model_name_or_path=str(tiny_moe_path)),
        _mixture(one=(one, None)),
        MoESFTArguments(),
    )
    losses = [entry["loss"] for entry in stage1.log_history if "loss" in entry]
    assert losses[-1] < losses[0] - 0.5, losses
    assert any("aux_loss" in entry for entry in stage1.log_history)  # the router loss shows in the logs
    _assert_complete_checkpoint(stage1.output, stage1.model, stages=1, remote=False)  # stage 2 checks it

    # Stage 2 starts from stage 1's folder; 10% of its examples replay stage 1 (TRL's `fraction`).
    stage2_args = (
        ScriptArguments(),
        _sft_args(tmp_path / "stage2", max_steps=6),
        ModelConfig(model_name_or_path=str(stage1.output)),
        _mixture(two=(two, 0.9), one=(one, 0.1)),
        MoESFTArguments(freeze_routers=True),
    )
    trainer, stage = build_sft_trainer(*stage2_args)
    assert stage["shares"] == {f"{tmp_path.name}/two.jsonl": 0.9, f"{tmp_path.name}/one.jsonl": 0.1}
    assert stage["examples"] == 222  # TRL's fractions without oversampling: 200 / 0.9 rows in all, 22 replayed
    assert _replay_share(trainer) == pytest.approx(0.1, abs=0.01)

    stage2 = run_sft(*stage2_args)
    history = _assert_complete_checkpoint(stage2.output, stage2.model, stages=2)
    assert history[0]["lr_scheduler_kwargs"] == {"min_lr": 3e-4}
    assert history[1]["started_from"] == "stage1" and history[1]["freeze_routers"] is True
    assert history[1]["examples"] == 222 and stage2.model.config.output_router_logits is False
    card = (stage2.output / "README.md").read_text()
    assert "cosine_with_min_lr (min_lr 0.0003)" in card  # the schedule's end shows in the stage row
    assert card.count("## Training") == 1 and card.count("## Usage") == 1  # stage 1's card is not nested
    before, after = stage1.model.state_dict(), stage2.model.state_dict()
    assert torch.equal(before["model.layers.0.mlp.gate.weight"], after["model.layers.0.mlp.gate.weight"])
    assert not torch.equal(
        before["model.layers.0.mlp.experts.down_proj"], after["model.layers.0.mlp.experts.down_proj"]
    )


@pytest.mark.parametrize("train_routers", [False, True])
def test_lora_sft_saves_the_merged_model_and_the_adapter(tiny_moe_path, tmp_path, umask_022, train_routers):
    """LoRA on the attention and the fused experts from the recipe's fields (TRL's ModelConfig): the output is the
    merged model, and the base model plus the adapter beside it gives its logits; routers frozen or trained in full."""
    from peft import PeftModel

    data = _write_jsonl(tmp_path / "one.jsonl", _chats("alpha", 100))
    model_args = ModelConfig(
        model_name_or_path=str(tiny_moe_path),
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_target_modules=["q_proj", "v_proj"],
        lora_target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    moe = MoESFTArguments(lora_train_routers=train_routers)
    outcome = run_sft(
        ScriptArguments(), _sft_args(tmp_path / "out", max_steps=6), model_args, _mixture(one=(data, None)), moe
    )
    (stage,) = _assert_complete_checkpoint(outcome.output, outcome.model, stages=1, remote=train_routers)
    assert stage["lora"]["r"] == 4 and stage["lora"]["trained_in_full"] == (["gate"] if train_routers else None)
    assert "trained LoRA adapters (r 4, alpha 8" in (outcome.output / "README.md").read_text()
    adapter = outcome.output / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "model"
    assert not any(str(tiny_moe_path) in path.read_text(errors="ignore") for path in adapter.iterdir())

    base = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32)
    routers_before = base.model.layers[0].mlp.gate.weight.clone()
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    ids = token_batch()
    torch.testing.assert_close(logits(with_adapter, ids), logits(outcome.model, ids), atol=1e-5, rtol=1e-5)
    assert torch.equal(outcome.model.model.layers[0].mlp.gate.weight, routers_before) != train_routers
    experts = outcome.model.model.layers[0].mlp.experts.down_proj
    assert not torch.equal(
        experts, AutoModelForCausalLM.from_pretrained(tiny_moe_path).model.layers[0].mlp.experts.down_proj
    )


def _replay_share(trainer) -> float:
    """Share of stage-1 ("alpha") examples among the packed examples of one pass over the training batches."""
    counts = {"alpha": 0, "beta": 0}
    for batch in trainer.get_train_dataloader():
        ids, positions = batch["input_ids"][0], batch["position_ids"][0]
        starts = [*torch.nonzero(positions == 0).flatten().tolist(), len(ids)]
        for start, end in zip(starts, starts[1:]):
            text = trainer.processing_class.decode(ids[start:end]).replace(" ", "")
            counts["alpha" if "alpha" in text else "beta"] += 1
    return counts["alpha"] / sum(counts.values())


def test_recipe_files_parse_and_stage_one_runs_under_trl_sft(tiny_moe_path, tmp_path, umask_022):
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig, MoESFTArguments))
    *_, dataset_args, _ = parser.parse_args_and_config(
        ["--config", str(RECIPES / "sft/stage2-math-code.yaml"), "--use_cpu"]
    )
    assert [d.fraction for d in dataset_args.datasets] == [0.45, 0.45, 0.10]
    pretrain = TrlParser((ContinualPretrainArguments, TrainingArguments))
    args, training = pretrain.parse_args_and_config(["--config", str(RECIPES / "pretrain/llama-moe-v1.yaml")])
    assert (training.learning_rate, training.warmup_steps, args.router_aux_loss_coef) == (2e-4, 100, 0.01)
    assert training.lr_scheduler_kwargs == {"min_lr_rate": 0.1}

    # TRL's own command line never imports this package: the checkpoint's remote code trains.
    (tmp_path / "data/offline/sft/chat").mkdir(parents=True)
    _write_jsonl(tmp_path / "data/offline/sft/chat/train.jsonl", _chats("alpha", 40))
    command = [str(Path(sys.executable).with_name("trl")), "sft", "--config", str(RECIPES / "sft/stage1-general.yaml")]
    command += ["--model_name_or_path", str(tiny_moe_path), "--output_dir", "out", "--max_steps", "2"]
    command += ["--max_length", "64", "--use_cpu", "--per_device_train_batch_size", "2"]
    env = dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out/model.safetensors").stat().st_mode & 0o777 == 0o644
    # ... and the saved model carries our card and history (the installed package's save hook), data named
    history = json.loads((tmp_path / "out/training_history.json").read_text())
    assert [(stage["recipe"], stage["data"], stage["steps"]) for stage in history] == [
        ("trl sft", {"chat/train.jsonl": None}, 2)
    ]
    card = (tmp_path / "out/README.md").read_text()
    assert "| 1 | trl sft | chat/train.jsonl | 2 |" in card and "## The model training started from" in card
    assert "- trl-sft\n" in card  # a tag has no spaces
    assert str(tmp_path) not in card  # names, never local paths


def test_offline_data_has_disjoint_held_out_splits_and_correct_worked_answers(tmp_path):
    counts = build_offline_data(OfflineDataOptions(output=str(tmp_path / "data"), items_per_domain=60))
    assert set(counts) == {f"pretrain/{d}" for d in ("prose", "code", "math")} | {
        f"sft/{d}" for d in ("chat", "math", "code")
    }
    for name, count in counts.items():
        rows = {split: (tmp_path / "data" / name / f"{split}.jsonl").read_text().splitlines() for split in count}
        assert len(rows["test"]) == count["test"] >= 1 and len(rows["train"]) == count["train"] >= 1
        assert not set(rows["test"]) & set(rows["train"]), name
    for line in (tmp_path / "data/sft/math/train.jsonl").read_text().splitlines():
        answer = json.loads(line)["completion"][0]["content"]
        steps = re.findall(r"(\d+(?: [-+x/] \d+)+) = (\d+)", answer)
        assert steps and all(eval(expr.replace("x", "*")) == int(value) for expr, value in steps), answer
        assert answer.endswith(f"The answer is {steps[-1][1]}."), answer


def test_offline_data_chat_is_the_dense_models_own_answers(tmp_path, monkeypatch):
    """`--chat-tokens`: calibration prompts answered by the dense model, as text for distillation and as
    prompt/completion chats for SFT, the same conversations in both."""
    from helpers import CHAT_TEMPLATE, char_tokenizer, tiny_llama

    from llama_moe import loading

    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (tiny_llama().eval(), tokenizer, tmp_path))
    options = OfflineDataOptions(output=str(tmp_path / "data"), items_per_domain=20, chat_tokens=1024)
    counts = build_offline_data(options)
    assert sum(counts["pretrain/chat"].values()) == sum(counts["sft/self"].values()) >= 4
    text = json.loads((tmp_path / "data/pretrain/chat/train.jsonl").read_text().splitlines()[0])["text"]
    chat = json.loads((tmp_path / "data/sft/self/train.jsonl").read_text().splitlines()[0])
    prompt, answer = chat["prompt"][0]["content"], chat["completion"][0]["content"]
    assert text == f"user: {prompt}\nassistant: {answer}\n"

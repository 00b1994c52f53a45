"""Healing (`llama-moe convert --heal-tokens N`, `llama-moe heal`): each MoE MLP trained, layer after layer, to
reproduce the dense MLP's output on the converted earlier layers' states. The same result converting and healing in
one run or in two, deterministic, resumable after an interruption, closer to the dense model."""

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import load_moe, logits, one_error_line, tiny_llama, tiny_moe

from llama_moe.checkpoints import atomic
from llama_moe.commands import main
from llama_moe.conversion.healing import HealOptions, heal_folder
from llama_moe.conversion.healing import layer as healing_layer
from llama_moe.conversion.plan import resolve_recipe
from llama_moe_hf import MoERecipe, convert_to_moe

SPLIT_FIELDS = dict(method="random", num_experts=4, top_k=1, router_init="random", calibration_tokens=1024)
SPLIT = dict(SPLIT_FIELDS, eval=False)
HEAL = dict(heal_tokens=1024, heal_epochs=2, heal_target="mlp")  # the stream target (the default) has its own tests


def distance_to_dense(folder, tiny_dense):
    """Mean squared difference of the folder's logits from the dense model's on the fixture's tokens."""
    _, input_ids, dense_logits = tiny_dense
    return (logits(load_moe(folder), input_ids) - dense_logits).pow(2).mean()


def interrupt_the_first_training_of_layer_one(monkeypatch) -> list[int]:
    """Make healing stop (KeyboardInterrupt) the first time it trains layer 1; returns the layers it trains, in order,
    the interrupted one included."""
    trained, real_train = [], healing_layer._train_block

    def train(block, inputs, targets, settings, layer_idx):
        trained.append(layer_idx)
        if layer_idx == 1 and trained.count(1) == 1:
            raise KeyboardInterrupt
        return real_train(block, inputs, targets, settings, layer_idx)

    monkeypatch.setattr(healing_layer, "_train_block", train)
    return trained


def tensors(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_same_tensors(a, b):
    a, b = tensors(a), tensors(b)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def healed(tmp_path_factory, tiny_dense):
    root = tmp_path_factory.mktemp("healing")
    plain = convert_to_moe(tiny_dense[0], root / "plain", progress=False, **SPLIT)
    return root, plain.output_dir, convert_to_moe(tiny_dense[0], root / "healed", progress=False, **SPLIT, **HEAL)


def test_healing_brings_the_mlps_and_the_logits_closer_to_the_dense_model(healed, tiny_dense):
    _, plain, result = healed
    report = load_moe(result.output_dir).config.conversion_info["healing"]
    assert report["error_after"] < 0.5 * report["error_before"]
    assert report["tokens"] == 1024 and report["epochs"] == 2 and report["kept_layers"] == []
    assert report["device"] == "cpu" and report["threads"] == torch.get_num_threads()  # they decide the bytes too
    assert distance_to_dense(result.output_dir, tiny_dense) < 0.8 * distance_to_dense(plain, tiny_dense)
    assert not list(result.output_dir.parent.glob(".*healing"))  # the progress kept for a resume is gone


def test_converting_and_healing_in_one_run_or_two_give_the_same_weights(healed, tiny_dense, tmp_path):
    _, plain, result = healed
    options = HealOptions(output=str(tmp_path / "later"), **HEAL, progress=False)
    heal_folder(plain, options)  # the teacher: the dense model the folder was converted from
    assert_same_tensors(tmp_path / "later", result.output_dir)
    info = json.loads((tmp_path / "later" / "config.json").read_text())["conversion_info"]
    assert (
        info["healing"]["error_after"] == load_moe(result.output_dir).config.conversion_info["healing"]["error_after"]
    )
    assert "heal_tokens: 1024" in (tmp_path / "later" / "moe_recipe.yaml").read_text()
    assert "## Healing" in (tmp_path / "later" / "README.md").read_text()


def test_a_layer_that_training_makes_worse_keeps_the_weights_it_was_given(healed, tmp_path, monkeypatch):
    _, plain, _ = healed

    def spoil(block, *args):  # a step far too large
        with torch.no_grad():
            for parameter in block.parameters():
                parameter.add_(torch.randn_like(parameter))

    monkeypatch.setattr(healing_layer, "_train_block", spoil)
    heal_folder(plain, HealOptions(output=str(tmp_path / "out"), **HEAL, progress=False))
    report = load_moe(tmp_path / "out").config.conversion_info["healing"]
    assert report["kept_layers"] == [0, 1] and report["error_after"] == report["error_before"]
    assert_same_tensors(tmp_path / "out", plain)


def test_an_interrupted_heal_resumes_at_the_next_layer_and_ends_the_same(healed, tmp_path, monkeypatch):
    _, plain, result = healed
    trained = interrupt_the_first_training_of_layer_one(monkeypatch)
    options = HealOptions(output=str(tmp_path / "out"), **HEAL, progress=False)
    with pytest.raises(KeyboardInterrupt):
        heal_folder(plain, options)
    assert not (tmp_path / "out").exists() and (tmp_path / ".out.healing" / "layer_0.safetensors").is_file()
    heal_folder(plain, options)
    assert trained == [0, 1, 1]  # layer 0 was not trained again
    assert_same_tensors(tmp_path / "out", result.output_dir)
    assert not (tmp_path / ".out.healing").exists()


def test_a_heal_resumed_under_another_thread_count_records_each_layers(healed, tmp_path, monkeypatch):
    _, plain, _ = healed
    interrupt_the_first_training_of_layer_one(monkeypatch)
    threads = torch.get_num_threads()
    with monkeypatch.context() as first_run:
        first_run.setattr(healing_layer.torch, "get_num_threads", lambda: threads + 1)
        with pytest.raises(KeyboardInterrupt):
            heal_folder(plain, HealOptions(output=str(tmp_path / "out"), **HEAL, progress=False))
    heal_folder(plain, HealOptions(output=str(tmp_path / "out"), **HEAL, progress=False))
    report = json.loads((tmp_path / "out" / "config.json").read_text())["conversion_info"]["healing"]
    assert report["threads"] == [threads + 1, threads] and report["device"] == "cpu"  # layer 0 ran first


def test_an_interrupted_convert_resumes_even_in_a_folder_it_created_and_never_from_another_conversion(
    healed, tiny_dense, tmp_path, monkeypatch
):
    """The progress lives beside the output, so the parent folders the convert created stay while it is there; a
    conversion with other settings (here another seed) into the same output starts over."""
    _, _, result = healed
    trained = interrupt_the_first_training_of_layer_one(monkeypatch)
    output = tmp_path / "new" / "parent" / "out"
    with pytest.raises(KeyboardInterrupt):
        convert_to_moe(tiny_dense[0], output, progress=False, **{**SPLIT, "seed": 1}, **HEAL)
    assert (output.parent / ".out.healing" / "layer_0.safetensors").is_file() and not output.exists()
    convert_to_moe(tiny_dense[0], output, progress=False, **SPLIT, **HEAL)
    assert trained == [0, 1, 0, 1]  # seed 0 is another conversion: nothing of seed 1's progress is used
    assert_same_tensors(output, result.output_dir)


def test_a_heal_interrupted_under_another_release_starts_over(healed, tmp_path, monkeypatch):
    """Healing's code changes between releases (its rounding did): a resume never mixes their layers."""
    import llama_moe_hf

    _, plain, result = healed
    trained = interrupt_the_first_training_of_layer_one(monkeypatch)
    options = HealOptions(output=str(tmp_path / "out"), **HEAL, progress=False)
    with monkeypatch.context() as older_release:
        older_release.setattr(llama_moe_hf, "__version__", "0.0.1")
        with pytest.raises(KeyboardInterrupt):
            heal_folder(plain, options)
    heal_folder(plain, options)
    assert trained == [0, 1, 0, 1]
    assert_same_tensors(tmp_path / "out", result.output_dir)


def test_a_heal_killed_between_its_writes_resumes_from_a_consistent_layer(healed, tmp_path, monkeypatch):
    """Killed after a layer's states were written but before the record naming the layer: the record's layer and its
    states still belong together, and the run ends as an uninterrupted one."""
    _, plain, result = healed
    calls, real_atomic_file = [], atomic.atomic_file

    @contextlib.contextmanager
    def die_before_the_second_record(path):
        calls.append(Path(path).name)
        if calls[-1] == healing_layer.STATE_FILE and calls.count(healing_layer.STATE_FILE) == 2:
            raise KeyboardInterrupt
        with real_atomic_file(path) as tmp:
            yield tmp

    monkeypatch.setattr(atomic, "atomic_file", die_before_the_second_record)
    options = HealOptions(output=str(tmp_path / "out"), **HEAL, progress=False)
    with pytest.raises(KeyboardInterrupt):
        heal_folder(plain, options)
    heal_folder(plain, options)
    assert_same_tensors(tmp_path / "out", result.output_dir)


def test_bad_healing_settings_and_teachers_are_one_line(healed, tmp_path, capsys):
    root, plain, _ = healed
    assert (
        main(["convert", "--model", str(root / "plain"), "--output", str(tmp_path / "x"), "--heal-tokens", "-1"]) == 2
    )
    assert "--heal-tokens must be >= 0" in one_error_line(capsys)
    soap = ["convert", "--family", "soap_moe", "--output", str(tmp_path / "s"), "--heal-tokens", "512"]
    assert main(soap) == 2
    assert "--heal-tokens does not apply to the soap_moe family" in one_error_line(capsys)
    schedule = ["convert", "--model", str(root / "plain"), "--output", str(tmp_path / "x"), "--heal-tokens", "512"]
    assert main([*schedule, "--heal-schedule", "warmup"]) == 2
    assert "invalid choice: 'warmup' (choose from 'constant', 'cosine', 'linear')" in one_error_line(capsys)
    with pytest.raises(ValueError, match="--heal-schedule must be one of constant, cosine, linear"):  # a recipe file
        resolve_recipe(MoERecipe(**SPLIT_FIELDS, heal_tokens=256, heal_schedule="warmup"))
    tiny_llama(num_hidden_layers=3).save_pretrained(tmp_path / "other")  # not the dense model of this MoE
    capsys.readouterr()
    assert main(["heal", str(plain), "--output", str(tmp_path / "y"), "--teacher", str(tmp_path / "other")]) == 2
    assert "The teacher is not the dense model of this MoE" in one_error_line(capsys)
    assert not (tmp_path / "y").exists()


def test_the_learning_rate_follows_the_heal_schedule_in_each_layer(healed, tmp_path, monkeypatch):
    _, plain, _ = healed
    rates, real_step = [], torch.optim.Adam.step

    def record(optimizer, *args, **kwargs):
        rates.append(optimizer.param_groups[0]["lr"])
        return real_step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", record)
    options = HealOptions(output=str(tmp_path / "cosine"), **HEAL, heal_schedule="cosine", progress=False)
    heal_folder(plain, options)
    layers = load_moe(tmp_path / "cosine").config.num_hidden_layers
    steps = len(rates) // layers  # 1024 tokens in steps of 512, twice
    assert steps == 4 and rates[:steps] == rates[steps : 2 * steps]
    assert rates[0] == 3e-3 and rates[1] > rates[2] > rates[3] > 0
    assert load_moe(tmp_path / "cosine").config.conversion_info["healing"]["schedule"] == "cosine"


def test_the_stream_target_carries_the_dense_models_own_states_and_resumes_the_same(
    healed, tiny_dense, tmp_path, monkeypatch
):
    """With `--heal-target stream` each MLP learns the dense model's states after its layer less the converted
    attention's output: the dense states the healer carries are transformers' own hidden states of the dense model,
    the first layer's target is the plain MLP target (the two models agree before it), and a resume ends the same."""
    from transformers import AutoModelForCausalLM

    _, plain, _ = healed
    seen, real_init, real_targets = {}, healing_layer.LayerHealer.__init__, healing_layer.LayerHealer._targets

    def keep_tokens(self, settings, config, layer_class, rotary_class, embed_weight, input_ids, *args):
        seen["input_ids"] = input_ids
        real_init(self, settings, config, layer_class, rotary_class, embed_weight, input_ids, *args)

    def keep_states(self, layer, inputs, attended, dense):
        targets = real_targets(self, layer, inputs, attended, dense)
        seen.setdefault("targets", targets)
        seen.setdefault("mlp", healing_layer._swiglu(inputs, dense, self.config.hidden_act))
        seen.setdefault("states", []).append(self.dense_hidden.clone())
        return targets

    monkeypatch.setattr(healing_layer.LayerHealer, "__init__", keep_tokens)
    monkeypatch.setattr(healing_layer.LayerHealer, "_targets", keep_states)
    options = HealOptions(output=str(tmp_path / "stream"), **{**HEAL, "heal_target": "stream"}, progress=False)
    heal_folder(plain, options)
    dense = AutoModelForCausalLM.from_pretrained(tiny_dense[0], dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        expected = dense(seen["input_ids"], output_hidden_states=True).hidden_states[1:-1]  # the last is normed
    for layer, (states, wanted) in enumerate(zip(seen["states"], expected)):
        torch.testing.assert_close(states, wanted, rtol=1e-4, atol=1e-5, msg=f"layer {layer}")
    torch.testing.assert_close(seen["targets"], seen["mlp"], rtol=1e-5, atol=1e-6)
    assert load_moe(tmp_path / "stream").config.conversion_info["healing"]["target"] == "stream"
    assert "the dense model's hidden states after its layer" in (tmp_path / "stream" / "README.md").read_text()
    assert distance_to_dense(tmp_path / "stream", tiny_dense) < distance_to_dense(plain, tiny_dense)

    monkeypatch.setattr(healing_layer.LayerHealer, "_targets", real_targets)
    interrupt_the_first_training_of_layer_one(monkeypatch)
    options = HealOptions(output=str(tmp_path / "resumed"), **{**HEAL, "heal_target": "stream"}, progress=False)
    with pytest.raises(KeyboardInterrupt):
        heal_folder(plain, options)
    heal_folder(plain, options)  # the dense states come back from the saved progress
    assert_same_tensors(tmp_path / "resumed", tmp_path / "stream")


def test_the_stream_target_is_the_default_except_with_attention_experts_where_it_is_one_line(
    tiny_dense, tmp_path, capsys
):
    attention = dict(family="attn_moe", attn_experts=4, attn_top_k=2, mlp_moe=True)
    assert resolve_recipe(MoERecipe(**SPLIT_FIELDS, heal_tokens=256)).heal_target == "stream"
    with pytest.raises(ValueError, match="pass the recipe through resolve_recipe first"):  # no silent mlp target
        healing_layer.HealSettings.from_recipe(MoERecipe(**SPLIT_FIELDS, heal_tokens=256))
    recipe = MoERecipe.from_dict({**SPLIT_FIELDS, **attention, "heal_tokens": 256})
    assert resolve_recipe(recipe).heal_target == "mlp"
    split = ["--family", "attn_moe", "--attn-experts", "4", "--attn-top-k", "2", "--mlp-moe", "true", "--top-k", "2"]
    command = ["convert", "--model", str(tiny_dense[0]), *split, "--num-experts", "4", "--heal-tokens", "256"]
    assert main([*command, "--output", str(tmp_path / "a"), "--heal-target", "stream"]) == 2
    assert "--heal-target stream needs the dense model's attention in every layer" in one_error_line(capsys)
    assert not (tmp_path / "a").exists()
    assert main([*command, "--heal-target", "everything", "--output", str(tmp_path / "b")]) == 2
    assert "invalid choice: 'everything' (choose from 'stream', 'mlp')" in one_error_line(capsys)
    with pytest.raises(ValueError, match="--heal-target must be one of stream, mlp"):
        resolve_recipe(MoERecipe(**SPLIT_FIELDS, heal_tokens=256, heal_target="everything"))


def test_the_presets_healing_gives_the_same_weights_converting_or_healing_later(tiny_dense, tmp_path):
    """What `--preset sparse-25-selector` runs (residual split, selector, compensation, stream target) heals the same
    while converting as `llama-moe heal` does on the training-free folder afterwards."""
    preset = dict(method="residual", num_experts=3, num_shared_experts=1, router_init="selector", compensation=True)
    fields = dict(SPLIT, **preset, progress=False)  # the module's split settings, with the preset's construction
    # at the default rate, 4 steps overshoot on this tiny model and every layer keeps its built weights
    heal = dict(heal_tokens=1024, heal_epochs=2, heal_lr=3e-4, heal_target="stream")
    plain = convert_to_moe(tiny_dense[0], tmp_path / "plain", **fields).output_dir
    at_once = convert_to_moe(tiny_dense[0], tmp_path / "at_once", **fields, **heal).output_dir
    heal_folder(plain, HealOptions(output=str(tmp_path / "later"), **heal, progress=False))
    assert_same_tensors(tmp_path / "later", at_once)
    before, after = tensors(plain), tensors(at_once)
    assert any(not torch.equal(before[name], after[name]) for name in before)  # healing changed the experts


def test_the_routing_energy_is_what_each_token_loses_without_each_expert():
    """`_energy` runs every expert at once; it equals `|expert_e(x) - compensation_e|^2`, one expert at a time."""
    block = tiny_moe(moe_compensation=True).model.layers[0].mlp
    torch.nn.init.normal_(block.compensation, std=0.1)
    states = torch.randn(9, block.experts.hidden_dim)
    expected = torch.stack(
        [
            (block.experts.expert(states, e) - block.compensation[e]).pow(2).sum(-1)
            for e in range(block.experts.num_experts)
        ],
        1,
    )
    torch.testing.assert_close(healing_layer._energy(block, states), expected)


def test_a_heal_says_its_forecast_and_stops_where_it_will_not_fit(healed, tmp_path, monkeypatch, capsys, caplog):
    """`llama-moe heal` forecasts its layer heal (memory, time, disk) before any weight is read, and stops with one
    line where it will not fit; --force heals anyway."""
    from llama_moe import footprint

    root, plain, _ = healed
    argv = ["heal", str(plain), "--output", str(tmp_path / "out"), "--heal-tokens", "256", "--no-progress"]
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 0.5 * footprint.GIB)
    assert main(argv) == 2
    assert one_error_line(capsys).startswith("error: The layer heal stage needs about 1.0 GiB and 0.5 GiB is free")
    assert not (tmp_path / "out").exists()
    with caplog.at_level("DEBUG", logger="llama_moe.conversion.forecast"):
        assert main([*argv, "--force"]) == 0
    forecast = rf"Forecast: layer heal 1\.0 GiB ~\d+ s \(free 0\.5 GiB\); on disk: layer heal 0\.0 GiB in {tmp_path}\."
    assert re.search(forecast, caplog.text) and (tmp_path / "out" / "model.safetensors").is_file()

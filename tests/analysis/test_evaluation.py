"""`llama-moe eval`: sliding-window perplexity against the model's own loss, parameter counts, lm-eval on the local
task, Hub ids through the download seam, and the command's results file."""

import json
import math

import pytest
import torch
from helpers import char_tokenizer, save_tiny_dense, save_tiny_moe, tiny_llama, tiny_moe

from llama_moe.commands import main
from llama_moe.evaluation.evaluate import evaluate, measure
from llama_moe.evaluation.options import EvalOptions
from llama_moe.perplexity import sliding_window_perplexity, windows

TOKENS = torch.randint(3, 128, (96,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return path


def test_every_token_with_context_in_its_window_is_scored_once():
    for length, window, stride in ((96, 32, 8), (97, 32, 16), (5, 8, 3)):  # overlapping: every token but the first
        scored = [p for _, end, first in windows(length, window, stride) for p in range(first, end)]
        assert scored == list(range(1, length))
    scored = [p for _, end, first in windows(96, 32, 32) for p in range(first, end)]
    assert scored == [p for p in range(96) if p % 32]  # side by side: a window's first token has no context
    with pytest.raises(ValueError, match="--stride <= --window"):
        windows(10, 4, 5)


@torch.no_grad()
def test_perplexity_without_overlap_is_the_model_loss():
    model = tiny_moe()
    chunks = TOKENS.view(3, 32)
    direct = math.exp(sum(model(c[None], labels=c[None]).loss.item() for c in chunks) / 3)  # equal token counts
    result = sliding_window_perplexity(model, TOKENS, window=32, stride=32, batch_size=2)
    assert result.tokens == 3 * 31 and result.perplexity == pytest.approx(direct, rel=1e-5)


@torch.no_grad()
def test_sliding_window_perplexity_is_the_model_loss_over_the_scored_labels():
    model = tiny_moe()
    nll = count = 0
    for begin, end, first in windows(96, 32, 12):
        ids = TOKENS[begin:end][None]
        labels = ids.clone()
        labels[:, : first - begin] = -100  # context only: scored in an earlier window
        nll += model(ids, labels=labels).loss.item() * (end - first)
        count += end - first
    result = sliding_window_perplexity(model, TOKENS, window=32, stride=12, batch_size=3)
    assert result.tokens == count == 95
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_dense_model_counts_every_parameter_as_active(text_file):
    options = EvalOptions(data=[str(text_file)], window=32, max_tokens=128)
    dense = measure(tiny_llama(), char_tokenizer(), options.sources(), options)
    moe = measure(tiny_moe(), char_tokenizer(), options.sources(), options)
    assert dense["parameters"]["total"] == dense["parameters"]["active"]
    assert moe["parameters"]["active"] < moe["parameters"]["total"]
    for results in (dense, moe):
        (result,) = results["perplexity"].values()
        assert result["tokens"] == 127 and result["tokens_per_second"] > 0 and result["perplexity"] > 1
        assert result["dataset"] is None  # local text: the card's model-index names no local file as a dataset


def test_lm_eval_runs_the_local_task_offline():
    pytest.importorskip("lm_eval")
    options = EvalOptions(data=[], tasks=["llama_moe_arithmetic"], limit=8, window=32, max_tokens=64)
    results = measure(tiny_moe(), char_tokenizer(), {"stdlib-docstrings": None}, options)
    scores = results["lm_eval"]["llama_moe_arithmetic"]
    assert 0.0 <= scores["acc"] <= 1.0 and "acc_norm" in scores and results["lm_eval_version"]


def test_hub_id_goes_through_the_download_seam(tmp_path, text_file):
    folder = tmp_path / "cache" / "me--tiny"
    save_tiny_moe(folder)
    asked = []

    def download(repo_id, **kwargs):
        asked.append(repo_id)
        return str(folder)

    options = EvalOptions(data=[f"fox={text_file}"], window=32, max_tokens=64, output=str(tmp_path / "r.json"))
    results, path = evaluate("me/tiny", options, download=download)
    assert asked == ["me/tiny"] and path == tmp_path / "r.json"
    assert json.loads(path.read_text())["perplexity"]["fox"]["tokens"] == 63
    assert results["model"] == "me/tiny" and not (folder / "eval_results.json").exists()


def test_command_writes_results_into_the_model_folder(tmp_path, text_file, capsys):
    folder = tmp_path / "dense"
    save_tiny_dense(folder)
    assert main(["eval", str(folder), "--data", str(text_file), "--window", "32", "--max-tokens", "96"]) == 0
    out = capsys.readouterr().out
    assert "perplexity text.txt:" in out and "(95 tokens" in out
    saved = json.loads((folder / "eval_results.json").read_text())
    assert saved["dtype"] == "float32" and saved["window"] == 32 and saved["stride"] == 16
    assert (folder / "eval_results.json").stat().st_mode & 0o777 == 0o666 & ~_umask()
    assert main(["eval", str(tmp_path / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    assert main(["eval", str(folder), "--stride", "64", "--window", "32"]) == 2


def _umask() -> int:
    from llama_moe.checkpoints.atomic import current_umask

    return current_umask()


def test_local_lm_eval_tasks_carry_the_prefix_the_card_skips_them_by():
    from llama_moe.evaluation.harness import local_tasks
    from llama_moe.hub.card import LOCAL_TASK_PREFIX, eval_results

    tasks = local_tasks()
    assert tasks and all(name.startswith(LOCAL_TASK_PREFIX) for name in tasks)
    results = {"lm_eval": {name: {"acc": 0.5} for name in [*tasks, "hellaswag"]}}
    assert [entry.dataset_type for entry in eval_results(results)] == ["hellaswag"]

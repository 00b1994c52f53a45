"""`llama-moe` command line: convert / info / push / chat, and clean `error:` exits on bad input."""

import json
import subprocess
import sys

import pytest
from test_convert import save_tiny_dense
from test_hub import FakeHfApi

from llama_moe_hf.cli import main
from llama_moe_hf.conversion import hub


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "dense"
    save_tiny_dense(path)
    return path


def test_convert_info_and_dry_run_push(tmp_path, dense, capsys):
    out = tmp_path / "moe"
    argv = ["convert", "--model", str(dense), "--output", str(out), "--method", "sequential", "--num-experts", "4",
            "--top-k", "2", "--num-shared-experts", "0", "--score-scale-factor", "1.5", "--moe-layers", "1",
            "--seed", "7", "--dtype", "bfloat16", "--router-init", "zero", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["moe_layers"] == [1] and config["score_scale_factor"] == 1.5 and config["dtype"] == "bfloat16"
    assert (
        config["conversion_info"] | {"method": "sequential", "seed": 7, "router_init": "zero"}
        == config["conversion_info"]
    )
    total_line = next(line for line in printed.splitlines() if line.startswith("total parameters"))
    active_line = next(line for line in printed.splitlines() if line.startswith("active parameters per token"))

    assert main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert total_line in info and active_line in info and "top-2" in info

    assert main(["push", str(out), "--repo-id", "me/tiny-moe", "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert "Would upload" in dry and "model.safetensors" in dry and "library_name: transformers" in dry


def test_convert_push_to_hub_uses_the_hub_client(tmp_path, dense, capsys, monkeypatch):
    api = FakeHfApi()
    monkeypatch.setattr(hub, "HfApi", lambda token=None: api)
    argv = ["convert", "--model", str(dense), "--output", str(tmp_path / "moe"), "--method", "upcycle",
            "--num-experts", "2", "--push-to-hub", "--repo-id", "me/up", "--private", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert [call[0] for call in api.calls] == ["create_repo", "upload_folder"]
    assert 'from_pretrained("me/up"' in api.uploaded_readme
    assert "pushed: https://huggingface.co/me/tiny-moe/commit/abc" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-experts", "4", "--top-k", "9"], "error: --top-k must be between 1 and --num-experts=4"),
        (["--push-to-hub"], "error: --push-to-hub needs --repo-id"),
        (["--num-experts", "7"], "error: Cannot split an FFN of 96 neurons into 7 equal experts"),
    ],
)
def test_bad_input_exits_2_with_one_error_line(tmp_path, dense, capsys, args, message):
    out = tmp_path / "moe"
    assert main(["convert", "--model", str(dense), "--output", str(out), "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_module_entry_point_in_a_subprocess(tmp_path, dense):
    existing = tmp_path / "existing"
    existing.mkdir()
    cmd = [sys.executable, "-m", "llama_moe_hf.cli", "convert", "--model", str(dense), "--output", str(existing)]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("error: Output folder") and "Traceback" not in run.stderr
    assert list(existing.iterdir()) == []


@pytest.mark.slow
def test_chat_with_converted_smollm2(tmp_path, smollm2_path, capsys):
    # Upcycled experts compute exactly the dense FFN, so the answer is the dense model's answer.
    out = tmp_path / "smol-moe"
    argv = ["convert", "--output", str(out), "--model", str(smollm2_path), "--method", "upcycle",
            "--num-experts", "2", "--top-k", "1", "--moe-layers", "0", "1", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["chat", str(out), "--prompt", "What is the capital of France?", "--max-new-tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out

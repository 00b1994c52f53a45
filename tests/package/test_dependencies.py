"""`pip install -e .` is enough for every documented command's default path; an option that needs an optional
package (an extra) is refused at once, before any model is loaded, with one line naming the install command."""

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import RECIPES, one_error_line, run_recipe
from packaging.requirements import Requirement

from llama_moe.commands import main
from llama_moe.preflight import OPTIONAL
from llama_moe.similarity import pipeline

ROOT = Path(__file__).parents[2]
IMPORT_NAMES = {"pyyaml": "yaml", "scikit-learn": "sklearn", "faiss-cpu": "faiss"}  # distribution -> module


def requirements() -> tuple[set[str], dict[str, set[str]]]:
    """(the modules install_requires provides, extra -> the modules it adds), from the installed package's metadata
    (what setup.py declared)."""
    required, extras = set(), {}
    for line in importlib.metadata.requires("llama-moe-hf"):
        requirement = Requirement(line)
        extra = re.search(r'extra == "([^"]+)"', str(requirement.marker or ""))
        target = extras.setdefault(extra.group(1), set()) if extra else required
        target.add(module_of(requirement.name))
    return required, extras


def module_of(distribution: str) -> str:
    name = distribution.lower()
    return IMPORT_NAMES.get(name, name.replace("-", "_"))


def imported_modules() -> set[str]:
    """Top-level third-party modules the packages and the recipes import."""
    files = [
        *(ROOT / "llama_moe_hf").rglob("*.py"),
        *(ROOT / "llama_moe").rglob("*.py"),
        *(ROOT / "recipes").glob("*.py"),
    ]
    names = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"llama_moe_hf", "llama_moe"}


def test_every_import_is_a_requirement_or_an_optional_package_checked_up_front():
    required, extras = requirements()
    assert {"k_means_constrained", "sklearn", "matplotlib", "datasets"} <= required  # convert, batch-similar, analyze
    # each optional one goes through preflight.require (DeepSpeed: `check_training`, for --deepspeed)
    assert imported_modules() - required == set(OPTIONAL)
    for module, (package, extra) in OPTIONAL.items():  # the install line the error prints installs the module
        assert module == module_of(package) in extras[extra], module


@pytest.mark.parametrize(
    "module, argv, message",
    [
        ("lm_eval", ["eval", "MODEL", "--tasks", "x"], "--tasks needs lm-eval: pip install 'llama-moe-hf[eval]'"),
        (
            "sentence_transformers",
            ["batch-similar", "--output", "OUT", "--embedder", "sentence-transformers", "--encoder", "some/model"],
            (
                "--embedder sentence-transformers needs sentence-transformers: "
                "pip install 'llama-moe-hf[sentence-transformers]'"
            ),
        ),
        ("faiss", ["batch-similar", "--output", "OUT", "--search", "faiss"], "pip install 'llama-moe-hf[similarity]'"),
    ],
)
def test_missing_optional_package_is_one_line_before_any_work(
    module, argv, message, tiny_dense, tmp_path, capsys, monkeypatch, no_model_loads
):
    monkeypatch.setitem(sys.modules, module, None)  # import fails: as if not installed
    monkeypatch.setattr(pipeline, "_documents", lambda options: pytest.fail("documents were read"))
    names = {"MODEL": str(tiny_dense[0]), "OUT": str(tmp_path / "out.jsonl")}
    assert main([names.get(arg, arg) for arg in argv]) == 2
    assert one_error_line(capsys).endswith(message)
    assert list(tmp_path.iterdir()) == []


def test_recipes_need_deepspeed_only_when_asked_and_say_so_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    config = ["--config", str(RECIPES / "sft/stage1-general.yaml"), "--output_dir", str(tmp_path / "out")]
    assert run_recipe("sft.py", [*config, "--deepspeed", str(RECIPES / "accelerate/ds_zero2.json")]) == 2
    expected = "error: --deepspeed (or an accelerate DeepSpeed config) needs deepspeed: "
    expected += "pip install 'llama-moe-hf[deepspeed]'"
    assert one_error_line(capsys) == expected
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch --config_file zero2.yaml` sets
    config = ["--config", str(RECIPES / "pretrain/llama-moe-v1.yaml"), "--output_dir", str(tmp_path / "out")]
    assert run_recipe("continual_pretrain.py", config) == 2
    assert one_error_line(capsys) == expected
    assert list(tmp_path.iterdir()) == []


HIDDEN = """
import sys
from importlib.machinery import PathFinder

class Hidden(PathFinder):  # finds nothing under the hidden name: as if the package were not installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] == sys.argv[1] else PathFinder.find_spec(name, path, target)

sys.meta_path[sys.meta_path.index(PathFinder)] = Hidden
from llama_moe.commands import main
sys.exit(main(sys.argv[2:]))
"""


def test_eval_tasks_without_lm_eval_installed_in_a_fresh_process(tiny_dense, tmp_path):
    command = [sys.executable, "-c", HIDDEN, "lm_eval", "eval", str(tiny_dense[0]), "--tasks", "llama_moe_arithmetic"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr == "error: --tasks needs lm-eval: pip install 'llama-moe-hf[eval]'\n"
    assert list(tmp_path.iterdir()) == []


def test_the_torch_floor_is_the_release_ci_tests():
    """setup.py's lowest torch is the one CI installs first and runs the suite on (tests/other_ends.py takes the
    newest): no release below it is claimed untested."""
    floor = next(r for r in map(Requirement, importlib.metadata.requires("llama-moe-hf")) if r.name == "torch")
    installed = re.search(r"torch==([\d.]+)", (ROOT / ".ci" / "run").read_text()).group(1)
    assert str(floor.specifier) == f">={'.'.join(installed.split('.')[:2])}", (floor, installed)
    readme = (ROOT / "README.md").read_text()
    assert f"pip install torch=={installed}" in readme and "download.pytorch.org/whl/cpu" in readme


def test_preparing_the_default_model_says_so_before_any_work(tmp_path, monkeypatch, capsys):
    from llama_moe.checkpoints import default

    def fetch(workdir):
        assert "Preparing the built-in default model" in capsys.readouterr().err  # before the download and loading
        raise OSError("stop here")

    monkeypatch.setattr(default, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(default, "_fetch_gguf", fetch)
    with pytest.raises(OSError, match="stop here"):
        default.default_model_path()
    assert not any(tmp_path.iterdir())  # nothing half-prepared is left

"""The smoke tests (`pytest -m smoke`: generation with and without the cache in every family, remote code, export)
at the other ends of the supported ranges: the lowest transformers release the pin allows and the newest torch pip
offers within ours, in a throwaway virtual environment that sees everything else installed for this interpreter (a
virtual environment's packages too) behind its own transformers and torch. The README's test command runs it after
the whole suite, which runs on the newest transformers and the torch installed first (the lowest we support, 2.13.0
in CI): together they cover both ends of both ranges.

    python tests/other_ends.py [pytest arguments]
"""

import re
import site
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from llama_moe_hf.modeling.configuration_llama_moe import TRANSFORMERS_REQUIREMENT, TRANSFORMERS_TESTED

ROOT = Path(__file__).resolve().parent.parent


def torch_requirement() -> str:
    """setup.py's torch requirement (read, not imported: setup.py runs setup() on import)."""
    return re.search(r'"(torch[^"]*)"', (ROOT / "setup.py").read_text()).group(1)


def main(pytest_args: list[str]) -> int:
    lowest = TRANSFORMERS_TESTED[0]
    with tempfile.TemporaryDirectory(prefix="llama-moe-other-ends-") as folder:
        venv.create(folder, with_pip=True)
        python = str(Path(folder) / "bin" / "python")
        see_installed_packages(python)
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--upgrade"]
        subprocess.run([*pip, f"transformers=={lowest}", torch_requirement()], check=True)
        ask = [python, "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"]
        torch_version, _ = subprocess.run(ask, check=True, capture_output=True, text=True).stdout.split()
        print(
            f"smoke tests on transformers {lowest}, the lowest of transformers{TRANSFORMERS_REQUIREMENT}, and torch "
            f"{torch_version}, the newest pip offers for {torch_requirement()}",
            flush=True,
        )
        tests = Path(__file__).resolve().parent
        # the README's test command's options
        pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile"]
        command = [*pytest, "-m", "smoke", str(tests), *pytest_args]
        return subprocess.run(command, cwd=tests.parent).returncode


def see_installed_packages(python: str) -> None:
    """Make this interpreter's site-packages (with their .pth files: the editable install of this package) visible
    to the environment of `python`, after its own. `system_site_packages` would not do: from inside a virtual
    environment it reaches the base interpreter's packages, not the environment's."""
    ask = [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    purelib = Path(subprocess.run(ask, check=True, capture_output=True, text=True).stdout.strip())
    lines = [f"import site; site.addsitedir({folder!r})" for folder in site.getsitepackages()]
    (purelib / "installed-packages.pth").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

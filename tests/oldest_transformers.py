"""The smoke tests (`pytest -m smoke`: generation with and without the cache in every family, remote code, export)
on the lowest transformers release the pin allows, in a throwaway virtual environment that sees everything else
installed for this interpreter (a virtual environment's packages too) behind its own transformers. The README's test
command runs it after the whole suite, which runs on the release pip installed (the newest the pin allows): together
they cover both ends of the range.

    python tests/oldest_transformers.py [pytest arguments]
"""

import site
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from llama_moe_hf.modeling.configuration_llama_moe import TRANSFORMERS_REQUIREMENT, TRANSFORMERS_TESTED


def main(pytest_args: list[str]) -> int:
    lowest = TRANSFORMERS_TESTED[0]
    print(f"smoke tests on transformers {lowest}, the lowest of transformers{TRANSFORMERS_REQUIREMENT}", flush=True)
    with tempfile.TemporaryDirectory(prefix="llama-moe-oldest-") as folder:
        venv.create(folder, with_pip=True)
        python = str(Path(folder) / "bin" / "python")
        see_installed_packages(python)
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"transformers=={lowest}"]
        subprocess.run(pip, check=True)
        tests = Path(__file__).resolve().parent
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "smoke", str(tests), *pytest_args]
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

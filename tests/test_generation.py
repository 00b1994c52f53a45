"""Greedy generation with a KV cache equals generation without it, in every family, with the installed package and
as remote code without it: dynamic and static caches, left-padded batches, and generation from `inputs_embeds`.

transformers 5.24 renamed the models' `past_key_values` argument to `cache`; code written for one name generates
garbage with the cache on the other. CI runs this module on the lowest and the newest transformers the pin allows.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama

from llama_moe_hf import build_moe
from llama_moe_hf.modeling.configuration_llama_moe import LLAMA_MOE_VERSION, TRANSFORMERS_REQUIREMENT

pytestmark = pytest.mark.smoke

# Each family with decisive routing, so that a wrong cache changes which experts run, not only the attention.
FAMILIES = {
    "llama_moe": dict(method="random", num_experts=4, top_k=2, router_init="random"),
    "attn_moe": dict(attn_experts=4, attn_top_k=2, attn_router_init="random", mlp_moe=True, num_experts=4, top_k=2),
    "soap_moe": dict(family="soap_moe", num_experts=4, options={"segment_length": 4}),  # segments cross in decoding
}
PROMPTS = [[5, 17, 99, 42, 8, 71, 23, 64], [30, 12, 77, 4, 51]]  # the second is left-padded in the batch
MODES = ["dynamic", "static", "padded_dynamic", "padded_static", "embeds_dynamic"]


def sharpen_routers(model) -> None:
    for name, parameter in model.named_parameters():
        if name.endswith("gate.weight"):
            torch.nn.init.normal_(parameter, std=1.0, generator=torch.Generator().manual_seed(len(name)))


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    folders = {}
    for family, fields in FAMILIES.items():
        model = build_moe(tiny_llama(), **fields)
        assert model.config.model_type == family
        sharpen_routers(model)
        model.save_pretrained(root / family)
        folders[family] = root / family
    return folders


def run_generation_script(folders: dict[str, Path], *flags: str) -> dict:
    script = Path(__file__).with_name("generation_script.py")
    cmd = [sys.executable, str(script), *flags, json.dumps(PROMPTS), *map(str, folders.values())]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=next(iter(folders.values())).parent)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    return {family: results[str(folder)] for family, folder in folders.items()}


@pytest.fixture(scope="module")
def installed(family_folders):
    return run_generation_script(family_folders)


@pytest.fixture(scope="module")
def remote(family_folders):
    return run_generation_script(family_folders, "--remote-code")


def uncached_of(mode: str) -> str:
    return mode.rsplit("_", 1)[0] + "_uncached" if "_" in mode else "uncached"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_generation_equals_uncached_with_the_package(installed, family, mode):
    result = installed[family]
    assert result["module"].startswith("llama_moe_hf.modeling")
    assert result[mode] == result[uncached_of(mode)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_generation_equals_uncached_as_remote_code(remote, family, mode):
    result = remote[family]
    assert result["module"].startswith("transformers_modules")
    assert result[mode] == result[uncached_of(mode)]


@pytest.mark.parametrize("family", FAMILIES)
def test_remote_code_generates_what_the_package_generates(installed, remote, family):
    assert {k: v for k, v in remote[family].items() if k != "module"} == {
        k: v for k, v in installed[family].items() if k != "module"
    }
    # From embeddings the new tokens are those generated from the same ids.
    assert installed[family]["embeds_uncached"][0] == installed[family]["uncached"][0][len(PROMPTS[0]) :]


@pytest.mark.parametrize("version", ["5.22.2", "6.0.0"])
def test_remote_code_refuses_a_transformers_outside_the_pin_in_one_line(family_folders, version):
    script = (
        "import sys, transformers\n"
        f"transformers.__version__ = {version!r}  # what the folder's code sees\n"
        "sys.modules['llama_moe_hf'] = None\n"
        "from transformers import AutoConfig\n"
        "try:\n"
        "    AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(family_folders["soap_moe"])], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    pin = f"transformers{TRANSFORMERS_REQUIREMENT}"
    assert run.stdout.strip() == (
        f"This model's code (llama-moe-hf {LLAMA_MOE_VERSION}) needs {pin}, found {version}: pip install '{pin}'"
    )

"""Greedy generation with a KV cache equals generation without it, in every family, with the installed package and
as remote code without it: dynamic and static caches, left-padded batches, and generation from `inputs_embeds`.

transformers 5.24 renamed the models' `past_key_values` argument to `cache`; code written for one name generates
garbage with the cache on the other. CI runs this module on the lowest and the newest transformers the pin allows.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAMILY_FIELDS, run_generation_script, tiny_family_model

from llama_moe_hf.modeling.configuration_llama_moe import LLAMA_MOE_VERSION, TRANSFORMERS_REQUIREMENT

pytestmark = pytest.mark.smoke

PROMPTS = [[5, 17, 99, 42, 8, 71, 23, 64], [30, 12, 77, 4, 51]]  # the second is left-padded in the batch
MODES = ["dynamic", "static", "padded_dynamic", "padded_static", "embeds_dynamic"]


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    for family in FAMILY_FIELDS:
        model = tiny_family_model(family)
        assert model.config.model_type == family
        model.save_pretrained(root / family)
    return {family: root / family for family in FAMILY_FIELDS}


def generations(folders: dict[str, Path], *flags: str) -> dict[str, dict]:
    results = run_generation_script(list(folders.values()), PROMPTS, *flags)
    return {family: results[str(folder)] for family, folder in folders.items()}


@pytest.fixture(scope="module")
def installed(family_folders):
    return generations(family_folders)


@pytest.fixture(scope="module")
def remote(family_folders):
    return generations(family_folders, "--remote-code")


def uncached_of(mode: str) -> str:
    return mode.rsplit("_", 1)[0] + "_uncached" if "_" in mode else "uncached"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILY_FIELDS)
def test_cached_generation_equals_uncached_with_the_package(installed, family, mode):
    result = installed[family]
    assert result["module"].startswith("llama_moe_hf.modeling")
    assert result[mode] == result[uncached_of(mode)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILY_FIELDS)
def test_cached_generation_equals_uncached_as_remote_code(remote, family, mode):
    result = remote[family]
    assert result["module"].startswith("transformers_modules")
    assert result[mode] == result[uncached_of(mode)]


@pytest.mark.parametrize("family", FAMILY_FIELDS)
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
        "sys.modules['llama_moe_hf'] = sys.modules['llama_moe'] = None\n"
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


@pytest.mark.parametrize("family", list(FAMILY_FIELDS))
def test_the_old_cache_name_still_works_and_is_deprecated_where_transformers_deprecates_it(family):
    """transformers' common test `test_bc_cache_name_forward`: on 5.24+ `past_key_values=` gives the same output as
    `cache=` with transformers' FutureWarning; on 5.23 it is the standard name and warns nothing."""
    import warnings

    import torch
    from transformers import DynamicCache

    from llama_moe_hf.modeling.cache_compat import CACHE_ARG

    model = tiny_family_model(family).eval()
    input_ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = model(input_ids, past_key_values=DynamicCache(config=model.config), use_cache=True).logits
    new = model(input_ids, **{CACHE_ARG: DynamicCache(config=model.config)}, use_cache=True).logits
    torch.testing.assert_close(old, new)
    deprecated = [w for w in caught if "`past_key_values` is deprecated" in str(w.message)]
    assert bool(deprecated) == (CACHE_ARG == "cache")

#!/usr/bin/env python
"""Run transformers' own common model tests on llama-moe-hf's model families, with Mixtral's tests as the control.

transformers' wheel has no tests, and none are copied into this repository. For the installed release the script
takes tests/*.py from its PyPI sdist (test_modeling_common.py, ...) and gets the files the sdist lacks
(tests/causal_lm_tester.py, tests/generation/test_utils.py, tests/models/mixtral/..., package __init__ files) from
GitHub at the release tag, or from --source, a checkout of transformers at that tag; it finds them by following the
relative imports. They are kept in <cache-dir>/<version>/, where the sdist's files always win.

Each family gets a test module written after Mixtral's, tests/models/llama_moe_hf_<family>/test_modeling_<family>.py:
a CausalLMModelTester with tiny settings that use every MoE path of the family, and a CausalLMModelTest with
Mixtral's test_load_balancing_loss; the module also lists the family in transformers' auto name tables, by which the
common tests tell base models from heads, as an in-tree model is listed. pytest runs these modules with
tests/models/mixtral/test_modeling_mixtral.py, and the script prints the passed/failed/skipped/error counts of each
family next to Mixtral's as a Markdown table, then the failing tests of each and the tests each skips that Mixtral
passes, with the reason each gives.

examples:
  python tests/scripts/transformers_common_tests.py
  python tests/scripts/transformers_common_tests.py --family soap_moe -k "generate and not beam"
  python tests/scripts/transformers_common_tests.py --source ~/src/transformers   # a checkout at v<version>: no GitHub

exit status: 0 every test passed, 1 some test failed, 2 the tests could not be set up.
"""

import argparse
import ast
import importlib.util
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import transformers

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = Path.home() / ".cache" / "llama-moe-hf" / "transformers-tests"
GITHUB_RAW = "https://raw.githubusercontent.com/huggingface/transformers/v{version}/{path}"
MIXTRAL_TESTS = "tests/models/mixtral/test_modeling_mixtral.py"
# A file of the test tree named in a string literal: test_pipeline_mixin.py reads tests/utils/tiny_model_summary.json.
DATA_PATH = re.compile(r"tests/[\w./-]+\.\w+")
# Files that a test file imports through a sys.path entry of its own, which following relative imports cannot see:
# test_configuration_utils.py (for test_configuration_common.py) puts the checkout's utils/ on sys.path.
SYS_PATH_IMPORTS = {
    "tests/utils/test_configuration_utils.py": (
        "utils/test_module/__init__.py",
        "utils/test_module/custom_configuration.py",
    )
}
OUTCOMES = ("passed", "failed", "skipped", "error")
FAILING = ("failed", "error")


class SetupError(Exception):
    """The tests cannot be set up; the message is the line the user sees."""


@dataclass(frozen=True)
class Family:
    label: str  # its row in the table
    prefix: str  # llama_moe_hf.modeling's <prefix>Config, <prefix>Model, <prefix>ForCausalLM, ... classes
    fields: dict  # tester attributes; CausalLMModelTester.get_config passes those the config class takes
    skips: dict = field(default_factory=dict)  # test -> why the family cannot have it (like Mixtral's own skips)
    overrides: tuple = ()  # test class members (source, formatted with `prefix`) that adapt transformers' tests


# Tiny settings with every MoE path in use: a dense MLP layer and an MoE layer, routed and shared experts.
LLAMA_MOE_FIELDS = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "num_shared_experts": 1,
    "shared_expert_intermediate_size": 16,
    "moe_layers": [1],
}
# Attention experts (one query head each, two per KV group) in both layers, and an MLP MoE in layer 1.
ATTN_MOE_FIELDS = {
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_attention_experts": 4,
    "num_attention_experts_per_tok": 2,
    "attention_moe_layers": [0, 1],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "moe_layers": [1],
}
# Segments of 4 tokens: the testers' 7-token inputs span two, and generation goes on into a third.
SOAP_MOE_FIELDS = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "num_shared_experts": 1,
    "shared_expert_intermediate_size": 16,
    "segment_length": 4,
    "moe_layers": [1],
}
# transformers runs test_moe_models_record_router_logits only where the model's own file contains the text
# `@use_experts_implementation`. AttnMoE's MLP experts are LlamaMoE's (another file) and SoapMoE merges its experts
# (no kernel to pick); both record router logits, so the test runs with the family's file taken as containing it.
RECORD_ROUTER_LOGITS_TEST = """
    def test_moe_models_record_router_logits(self):
        module, getsource = inspect.getmodule({prefix}Model), inspect.getsource
        marked = lambda obj: getsource(obj) + ("\\n# @use_experts_implementation" if obj is module else "")
        with mock.patch("inspect.getsource", marked):
            super().test_moe_models_record_router_logits()
"""
# AttnMoE trains its attention routers with a Switch balance loss whenever router_aux_loss_coef > 0 (they are not in
# `router_logits`). That loss is a statistic of the batch a device sees, so data parallelism changes it, as it changes
# Mixtral's own aux loss, which Mixtral's tester leaves out of training (output_router_logits=False): the FSDP tests
# (one device against shards, 1e-5) compare the token-mean loss alone, as they do for Mixtral.
FSDP_WITHOUT_BALANCE_LOSS = """
    def _get_tiny_config(self):
        config_class, config_dict = super()._get_tiny_config()
        return config_class, {{**config_dict, "router_aux_loss_coef": 0.0}}
"""
# transformers gates its static-cache generation tests on `_can_compile_fullgraph`; SoapMoE generates with a static
# cache (uncompiled: its routing breaks the graph at host syncs), so those tests run with the gate lifted.
STATIC_CACHE_TESTS = "".join(
    f"""
    def {name}(self):
        with mock.patch.object({{prefix}}ForCausalLM, "_can_compile_fullgraph", True):
            super().{name}()
"""
    for name in ("test_generate_with_static_cache", "test_generate_from_inputs_embeds_with_static_cache")
)
# Checkpoints of these families exist in one layout only, the one llama-moe-hf writes (`llama-moe upgrade` replaces a
# folder's code, never its weights): a conversion mapping would have nothing to convert.
NO_OTHER_LAYOUT = "every checkpoint of the family is in the key layout llama-moe-hf writes: no conversion mapping"
CONVERSION_SKIPS = {
    name: NO_OTHER_LAYOUT for name in ("test_reverse_loading_mapping", "test_can_load_from_already_mapped_keys")
}
SOAP_NO_FULLGRAPH = (
    "SOAP routing reads segment offsets and padding counts on the host: compiled, the graph breaks there "
    "(torch.compile(model) runs with the breaks; generate does not compile it), so no fullgraph compile"
)
SOAP_SKIPS = {
    **CONVERSION_SKIPS,
    "test_load_balancing_loss": "SOAP merges every expert: it has no load-balancing loss (aux_loss is None)",
    "test_custom_4d_attention_mask": "SOAP routes each segment of a row by its tokens' mean; a custom 4D mask (sequences "
    "sharing a prefix in one row) has no segments of its own, so its sequences cannot be routed apart",
    **{
        f"test_eager_matches_batched_and_grouped_inference_{case}": "SOAP runs one merged FFN per segment: there is no "
        "per-token experts kernel for experts_implementation (eager/batched_mm/grouped_mm) to pick"
        for case in ("0_fp16", "1_fp32", "2_bf16")
    },
    **dict.fromkeys(
        (
            "test_generate_compile_model_forward_fullgraph",
            "test_generate_compilation_all_outputs",
            "test_static_cache_no_recompile_with_smaller_length",
        ),
        SOAP_NO_FULLGRAPH,
    ),
    **dict.fromkeys(
        ("test_moe_parallel_plans_shard_experts", "test_fsdp2_expert_parallel_bf16_grads_1_experts_not_sharded"),
        "SOAP merges every expert's weights for each segment, so each rank needs all of them: no expert parallelism",
    ),
}
FAMILIES = {
    "llama_moe": Family("LlamaMoE", "LlamaMoE", LLAMA_MOE_FIELDS, skips=CONVERSION_SKIPS),
    "attn_moe": Family(
        "AttnMoE",
        "AttnMoE",
        ATTN_MOE_FIELDS,
        skips=CONVERSION_SKIPS,
        overrides=(RECORD_ROUTER_LOGITS_TEST, FSDP_WITHOUT_BALANCE_LOSS),
    ),
    # The other attention-experts implementation: its own code path, so its own tests.
    "attn_moe_gathered": Family(
        "AttnMoE (gathered)",
        "AttnMoE",
        {**ATTN_MOE_FIELDS, "attention_experts_implementation": "gathered"},
        skips=CONVERSION_SKIPS,
        overrides=(RECORD_ROUTER_LOGITS_TEST, FSDP_WITHOUT_BALANCE_LOSS),
    ),
    "soap_moe": Family(
        "SoapMoE",
        "SoapMoE",
        SOAP_MOE_FIELDS,
        skips=SOAP_SKIPS,
        overrides=(RECORD_ROUTER_LOGITS_TEST, STATIC_CACHE_TESTS),
    ),
}

TEST_MODULE = '''\
"""transformers' common tests for {label}, after Mixtral's tests/models/mixtral/test_modeling_mixtral.py.

Written by tests/scripts/transformers_common_tests.py on every run: change that script, not this file.
"""

import inspect
import unittest
from unittest import mock

import torch
from transformers import set_seed
from transformers.models.auto import modeling_auto
from transformers.testing_utils import is_flaky, require_torch, torch_device

from llama_moe_hf.modeling import (  # also registers the families with the Auto classes
    {prefix}Config,
    {prefix}ForCausalLM,
    {prefix}ForQuestionAnswering,
    {prefix}ForSequenceClassification,
    {prefix}ForTokenClassification,
    {prefix}Model,
)

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester
from ...test_fsdp_mixin import FSDP_DISTRIBUTED_TEST_MODEL_TYPES

# The common tests tell base models from heads (which get labels, which are trained, ...) by the class names in the
# auto classes' name tables, which list transformers' own models only: list the family there as Mixtral is listed.
# (The auto mappings themselves know it through the import above; these tables only add names.)
for table, model_class in (
    (modeling_auto.MODEL_MAPPING_NAMES, {prefix}Model),
    (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, {prefix}ForCausalLM),
    (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, {prefix}ForSequenceClassification),
    (modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, {prefix}ForTokenClassification),
    (modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES, {prefix}ForQuestionAnswering),
):
    table.setdefault({prefix}Config.model_type, model_class.__name__)

# transformers runs its FSDP2 tests (each in 2 processes) for a list of model types, Mixtral's among them.
FSDP_DISTRIBUTED_TEST_MODEL_TYPES.add({prefix}Config.model_type)


class {prefix}ModelTester(CausalLMModelTester):
    # Set, not inferred: the inference looks for the classes in transformers' own model modules.
    base_model_class = {prefix}Model
    config_class = {prefix}Config
    causal_lm_class = {prefix}ForCausalLM
    sequence_classification_class = {prefix}ForSequenceClassification
    token_classification_class = {prefix}ForTokenClassification
    question_answering_class = {prefix}ForQuestionAnswering

    def __init__(self, parent):
        super().__init__(parent)
{fields}


@require_torch
class {prefix}ModelTest(CausalLMModelTest, unittest.TestCase):
    model_tester_class = {prefix}ModelTester
    # transformers runs this check of `_init_weights` (every weight initialised when loaded missing) for models it
    # dates from 2023 on by their file's copyright line, which ours have not: run it.
    test_can_init_all_missing_weights_before_2023 = True

{tests}'''

# Mixtral's own MoE test (MixtralModelTest.test_load_balancing_loss), with the family's names.
LOAD_BALANCING_TEST = '''
    @is_flaky(max_attempts=2)
    def test_load_balancing_loss(self):
        """Mixtral's test: the aux loss of 3 experts, top-2, is about 2 and leaves out masked padding tokens."""
        set_seed(42)
        config, input_dict = self.model_tester.prepare_config_and_inputs_for_common()
        config.num_labels = 3
        config.num_experts = 3
        config.output_router_logits = True
        input_ids = input_dict["input_ids"]
        attention_mask = input_ids.ne(1).to(torch_device)
        model = {prefix}ForCausalLM(config)
        model.to(torch_device)
        model.eval()
        result = model(input_ids, attention_mask=attention_mask)
        self.assertEqual(result.router_logits[0].shape, (input_ids.numel(), config.num_experts))
        torch.testing.assert_close(result.aux_loss.cpu(), torch.tensor(2, dtype=torch.float32), rtol=1e-2, atol=1e-2)

        # Left padding (token 1) under the attention mask does not change the loss ...
        padding_block = torch.ones(input_ids.shape[0], input_ids.shape[1] * 4, dtype=torch.int32).to(torch_device)
        padded_input_ids = torch.cat((padding_block, input_ids), dim=1)
        padded_attention_mask = padded_input_ids.ne(1).to(torch_device)
        padded_result = model(padded_input_ids, attention_mask=padded_attention_mask)
        torch.testing.assert_close(result.aux_loss.cpu(), padded_result.aux_loss.cpu(), rtol=1e-4, atol=1e-4)

        # ... and without the mask the padding tokens count.
        include_padding_result = model(padded_input_ids, attention_mask=None)
        self.assertNotAlmostEqual(include_padding_result.aux_loss.item(), result.aux_loss.item())
'''

SKIP = """
    @unittest.skip({reason!r})
    def {name}(self):
        pass
"""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--family",
        nargs="+",
        choices=sorted(FAMILIES),
        default=list(FAMILIES),
        metavar="FAMILY",
        help=f"families to test, of {', '.join(FAMILIES)} (default: all); Mixtral's tests always run",
    )
    parser.add_argument("-k", dest="keyword", metavar="EXPRESSION", help="passed to pytest -k: run matching tests only")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=DEFAULT_CACHE,
        help=f"where the test files are kept, in a folder per transformers version (default: {DEFAULT_CACHE})",
    )
    parser.add_argument(
        "--source",
        type=Path,
        metavar="DIR",
        help="a checkout of transformers at the installed version's tag: the files the sdist lacks are taken from it "
        "instead of GitHub (files already in the cache folder are kept)",
    )
    return parser.parse_args(argv)


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


class TestTree:
    """The test files of one transformers release under `root` (as `root/tests/...`), fetched on demand."""

    def __init__(self, root: Path, version: str, source: Path | None):
        self.root, self.version, self.source = root, version, source

    def fetch(self, rel: str) -> bytes | None:
        """`rel` from --source, else from GitHub at the release tag; None where the release has no such file."""
        if self.source is not None:
            path = self.source / rel
            return path.read_bytes() if path.is_file() else None
        url = GITHUB_RAW.format(version=self.version, path=rel)
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise SetupError(self.cannot_get(rel, f"{url} answered {error.code}")) from error
        except OSError as error:  # URLError included: no network, no DNS, a timeout
            raise SetupError(self.cannot_get(rel, f"{url}: {getattr(error, 'reason', error)}")) from error

    def cannot_get(self, rel: str, why: str | None = None) -> str:
        """The error for a file the tree lacks: GitHub could not be asked (`why`), or the release has no such file."""
        checkout = f"a checkout of transformers at v{self.version}"
        if why is not None:
            return f"cannot get {rel} of transformers {self.version} from GitHub ({why}); pass --source DIR, {checkout}"
        if self.source is not None:
            return f"{rel} is neither in the transformers sdist nor in --source {self.source}, which must be {checkout}"
        return f"{rel} is neither in the transformers sdist nor on GitHub at its tag; pass --source DIR, {checkout}"

    def ensure(self, *candidates: str) -> str | None:
        """The first of `candidates` already in the tree, else the first that can be fetched; None if none can."""
        for rel in candidates:
            if (self.root / rel).is_file():
                return rel
        for rel in candidates:
            data = self.fetch(rel)
            if data is not None:
                write(self.root / rel, data)
                return rel
        return None

    def require(self, *candidates: str) -> str:
        rel = self.ensure(*candidates)
        if rel is None:
            raise SetupError(self.cannot_get(" or ".join(candidates)))
        return rel

    def packages(self, rel: str) -> list[str]:
        """The __init__.py of every folder from tests/ down to `rel`'s, so that pytest imports the files as the
        `tests` package and their relative imports work; an empty one where the release has none."""
        inits = []
        if not rel.startswith("tests/"):
            return inits
        for folder in reversed(PurePosixPath(rel).parents[:-1]):
            init = f"{folder}/__init__.py"
            if self.ensure(init) is None:
                write(self.root / init, b"")
            inits.append(init)
        return inits


def dependencies(rel: str, text: str) -> tuple[list[tuple[str, ...]], list[str]]:
    """What a test file needs: for each relative import the paths its module may have, and the data files of the tree
    that its string literals name."""
    imports, data = [], []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = PurePosixPath(rel).parents[node.level - 1]
            modules = [node.module] if node.module else [alias.name for alias in node.names]
            for module in modules:
                path = base / module.replace(".", "/")
                imports.append((f"{path}.py", f"{path}/__init__.py"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DATA_PATH.fullmatch(node.value):
            data.append(node.value)
    return imports, data


def gather(tree: TestTree, roots: list[str]) -> None:
    """Fetch everything `roots` need, following relative imports from file to file."""
    seen, todo = set(), list(roots)
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        todo.extend(tree.packages(rel))
        if rel.endswith(".py"):
            imports, data = dependencies(rel, (tree.root / rel).read_text(encoding="utf-8"))
            todo.extend(tree.require(*candidates) for candidates in imports)
            todo.extend(tree.require(path) for path in [*data, *SYS_PATH_IMPORTS.get(rel, ())])


def extract_sdist_tests(root: Path, version: str) -> None:
    """The tests/ files of the transformers `version` sdist on PyPI, into root/tests (once per cache folder)."""
    stamp = root / ".sdist-extracted"
    if stamp.exists():
        return
    with tempfile.TemporaryDirectory() as download:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps"]
        command += [f"transformers=={version}", "-d", download]
        result = subprocess.run(command, check=False, capture_output=True, text=True)
        archives = list(Path(download).glob("transformers-*.tar.gz"))
        if result.returncode or not archives:
            why = (result.stderr.strip().splitlines() or ["pip found no sdist"])[-1]
            raise SetupError(f"cannot download the transformers {version} sdist from PyPI: {why}")
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                rel = member.name.partition("/")[2]  # below the archive's transformers-<version>/ folder
                if member.isfile() and rel.startswith("tests/") and ".." not in PurePosixPath(rel).parts:
                    write(root / rel, archive.extractfile(member).read())
    stamp.touch()


def write_family_tests(root: Path, name: str, family: Family) -> str:
    """The family's test module (regenerated every run, so it follows this script); returns its path in the tree."""
    tests = {"test_load_balancing_loss": LOAD_BALANCING_TEST.format(prefix=family.prefix)}
    tests.update({test: SKIP.format(name=test, reason=reason) for test, reason in family.skips.items()})
    tests.update(
        {str(number): override.format(prefix=family.prefix) for number, override in enumerate(family.overrides)}
    )
    fields = "\n".join(f"        self.{field_name} = {value!r}" for field_name, value in family.fields.items())
    text = TEST_MODULE.format(label=family.label, prefix=family.prefix, fields=fields, tests="".join(tests.values()))
    rel = f"tests/models/llama_moe_hf_{name}/test_modeling_{name}.py"
    write(root / rel, text.encode())
    return rel


def link_installed_transformers(root: Path) -> None:
    """test_pipeline_mixin.py imports transformers from the checkout's src/transformers: the installed one here."""
    link, target = root / "src" / "transformers", Path(transformers.__file__).resolve().parent
    if link.is_symlink() and link.resolve() == target:
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    link.symlink_to(target, target_is_directory=True)


def prepare(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The test tree of the installed transformers, ready to run; returns it and the test files to run."""
    missing = [name for name in ("pytest", "parameterized") if importlib.util.find_spec(name) is None]
    if missing:
        raise SetupError(f"transformers' tests need {' and '.join(missing)}: pip install {' '.join(missing)}")
    if args.source is not None and not (args.source.expanduser() / "tests").is_dir():
        raise SetupError(f"--source {args.source} has no tests/ folder: give the root of a transformers checkout")
    version = transformers.__version__
    root = args.cache_dir.expanduser().resolve() / version
    print(f"transformers {version}: test files in {root}", file=sys.stderr)
    extract_sdist_tests(root, version)
    source = args.source.expanduser().resolve() if args.source is not None else None
    tree = TestTree(root, version, source)
    files = [tree.require(MIXTRAL_TESTS)]
    files += [write_family_tests(root, name, FAMILIES[name]) for name in args.family]
    gather(tree, files)
    link_installed_transformers(root)
    # Pins pytest's rootdir here, so that no configuration file above the cache folder is read.
    (root / "pytest.ini").write_text("[pytest]\n")
    return root, files


def run_pytest(root: Path, files: list[str], keyword: str | None, junit: Path) -> int:
    command = [sys.executable, "-m", "pytest", *files, "-p", "no:cacheprovider", "-q", "--tb=short"]
    command.append(f"--junitxml={junit}")
    if keyword:
        command += ["-k", keyword]
    # This checkout's llama_moe_hf, whichever copy is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(command, check=False, cwd=root, env=env).returncode


def outcomes(junit: Path) -> dict[str, list[tuple[str, str, str]]]:
    """Per test module (dotted name), the (test, outcome, one-line message) of its tests in pytest's junit XML."""
    tags = {"failure": "failed", "error": "error", "skipped": "skipped"}
    results = {}
    for case in ET.parse(junit).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        module = classname.rpartition(".")[0] if classname else name  # a module that fails to import: its name
        outcome, message = "passed", ""
        for tag, result in tags.items():
            child = case.find(tag)
            if child is not None:
                outcome, message = result, summary(child)
                break
        results.setdefault(module, []).append((name, outcome, message))
    return results


def summary(element: ET.Element, width: int = 200) -> str:
    """One line for a failure, error or skip: its message, or for a module that fails to import (whose message is
    just "collection failure") the exception, the last line of the traceback."""
    message, text = element.get("message") or "", element.text or ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if message == "collection failure" and lines else message.strip().partition("\n")[0]
    return line if len(line) <= width else line[: width - 3] + "..."


def report(rows: list[tuple[str, str]], results: dict[str, list[tuple[str, str, str]]]) -> str:
    """The counts table, then each row's failing tests. `rows`: (label, test module)."""
    lines = ["| tests | " + " | ".join(OUTCOMES) + " |", "|---|" + "---:|" * len(OUTCOMES)]
    for label, module in rows:
        tests = results.get(module, [])
        counts = [sum(outcome == wanted for _, outcome, _ in tests) for wanted in OUTCOMES]
        lines.append(f"| {label} | " + " | ".join(map(str, counts)) + " |")
    for label, module in rows:
        failing = [(name, message) for name, outcome, message in results.get(module, []) if outcome in FAILING]
        lines += ["", f"### {label}: {len(failing)} failing"]
        lines += [f"- `{name}`: {message}" for name, message in failing]
    control = results.get(rows[0][1], [])
    for label, module in rows[1:]:
        skipped = skipped_where_control_passes(control, results.get(module, []))
        lines += ["", f"### {label}: {len(skipped)} skipped that {rows[0][0]} passes"]
        lines += [f"- `{name}`: {message}" for name, message in skipped]
    return "\n".join(lines)


def skipped_where_control_passes(control: list, tests: list) -> list[tuple[str, str]]:
    """(test, skip reason) of the `tests` skipped whose namesake passed in `control` (Mixtral's run)."""
    passed = {name for name, outcome, _ in control if outcome == "passed"}
    return [(name, message) for name, outcome, message in tests if outcome == "skipped" and name in passed]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        root, files = prepare(args)
    except SetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = [("Mixtral (control)", "tests.models.mixtral.test_modeling_mixtral")]
    rows += [(FAMILIES[name].label, f"tests.models.llama_moe_hf_{name}.test_modeling_{name}") for name in args.family]
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        status = run_pytest(root, files, args.keyword, junit)
        if not junit.exists():
            print(f"error: pytest stopped with status {status} before writing a report", file=sys.stderr)
            return 2
        results = outcomes(junit)
    print(report(rows, results))
    failed = any(outcome in FAILING for tests in results.values() for _, outcome, _ in tests)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

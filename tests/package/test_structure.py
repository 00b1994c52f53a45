"""The package's shape: no import cycle, a command line that starts without torch, Auto-class registration on
import, and tensor / expert parallel plans that run (two CPU processes over gloo)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llama_moe_hf import convert_to_moe

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "llama_moe"  # the tools and the command line
MODEL_PACKAGE = ROOT / "llama_moe_hf"  # the model code, which registers the families


def import_graph(*roots: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file, function-level imports included)."""
    modules = {}
    for file in (file for root in roots for file in root.rglob("*.py")):
        parts = list(file.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    graph = {}
    for name, file in modules.items():
        package = name if file.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets.update([base, *(f"{base}.{alias.name}" for alias in node.names)])
        # A module importing its own parent package is not a cycle (the parent finished its imports first).
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_the_package():
    graph = import_graph(PACKAGE, MODEL_PACKAGE)
    assert "llama_moe.conversion.methods.cluster" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_check_can_fail():
    graph = import_graph(PACKAGE, MODEL_PACKAGE)
    graph["llama_moe.conversion.registry"] = {"llama_moe.conversion.methods.random"}
    cycle = find_cycle(graph)
    assert cycle and {"llama_moe.conversion.registry", "llama_moe.conversion.methods.random"} <= set(cycle)


# The package's floors, lowest first: a module imports (anywhere in the file) only from its own floor or below, so
# that conversion never depends on what uses it. Peers on one floor may import each other.
FLOORS = [
    # llama_moe_hf: the model code and its registration; llama_moe: the tools' API, each name imported on first use
    {
        "llama_moe_hf",
        "llama_moe",
        "modeling",
        "registry",
        "perplexity",
        "behaviour",
        "lm_head",
        "distillation",
        "devices",
    },
    {"source_families", "preflight", "parsing"},
    {
        "checkpoints",
        "hub",
        "text",
    },  # text: the cache of what the dense model writes (`text.chat`) is written atomically
    {"conversion", "footprint"},  # footprint: memory estimates of conversions and training
    {"evaluation", "training", "similarity", "analysis", "export", "loading", "chat"},
    {"merging"},
    {"commands", "supported", "__main__"},
]


def floor_of(module: str) -> int:
    part = module.split(".")[1] if "." in module else module  # llama_moe_hf.modeling: modeling
    return next(i for i, floor in enumerate(FLOORS) if part in floor)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if floor_of(b) > floor_of(a))


def test_no_module_imports_from_a_higher_floor():
    graph = import_graph(PACKAGE, MODEL_PACKAGE)
    parts = {name.split(".")[1] if "." in name else name for name in graph}
    assert parts <= set().union(*FLOORS), f"give these parts a floor: {parts - set().union(*FLOORS)}"
    assert upward_imports(graph) == []
    graph["llama_moe.conversion.plan"].add("llama_moe.evaluation.evaluate")  # the check can fail
    assert upward_imports(graph) == ["llama_moe.conversion.plan -> llama_moe.evaluation.evaluate"]


MAX_FUNCTION_LINES = 60


def long_functions(files) -> list[str]:
    """`path:line name (N lines)` of every function longer than MAX_FUNCTION_LINES (decorators and docstring in)."""
    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{file}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_60_lines(tmp_path):
    """Package, recipes, benchmarks and tests: a function a reader takes in at once."""
    root = PACKAGE.parent
    files = [
        f
        for folder in ("llama_moe_hf", "llama_moe", "recipes", "benchmarks", "tests")
        for f in (root / folder).rglob("*.py")
    ]
    assert len(files) > 100
    assert long_functions(files) == []
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # 61 lines with the def: the check fails
    (tmp_path / "long.py").write_text(f"def f():\n{body}")
    assert long_functions([tmp_path / "long.py"]) == [f"{tmp_path / 'long.py'}:1 f (61 lines)"]


ROUTER_HOMES = ("llama_moe_hf/modeling", "llama_moe/conversion/routers")  # where a gate's name may be spelled out


def router_type_literals(files) -> list[str]:
    """`path:line` of every router type's name a `router_type` is compared with or set to: what a gate means is read
    from its class (`modeling.routers`), never decided by its name elsewhere."""
    from llama_moe_hf.modeling.routers import ROUTER_CLASSES

    def names(node) -> set:
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in ROUTER_CLASSES}

    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = any(isinstance(n, ast.Attribute) and n.attr.endswith("router_type") for n in sides)
                literal = any(names(n) for n in sides)
            elif isinstance(node, ast.keyword):
                named, literal = (node.arg or "").endswith("router_type"), bool(names(node.value))
            else:
                continue
            if named and literal:
                found.append(f"{file}:{getattr(node, 'lineno', None) or node.value.lineno}")
    return found


def test_no_router_type_is_decided_by_its_name_outside_the_router_classes(tmp_path):
    files = [f for f in PACKAGE.rglob("*.py") if not any(f"/{home}" in str(f) for home in ROUTER_HOMES)]
    assert router_type_literals(files) == []
    (tmp_path / "named.py").write_text('if config.router_type == "switch":\n    pass\nf(router_type="top_k")\n')
    assert len(router_type_literals([tmp_path / "named.py"])) == 2  # the check can fail


def test_the_command_line_answers_without_importing_torch_or_transformers():
    """`llama-moe --help` and argument errors: the command line's registries, recipe fields and parser are light."""
    for args, code in ((["--help"], 0), (["convert", "--help"], 0), (["convert", "--top-k", "x"], 2)):
        run = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "llama_moe", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == code, run.stderr[-2000:]
        imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
        assert "llama_moe.conversion.registry" in imported
        assert not {name for name in imported if name.split(".")[0] in ("torch", "transformers")}, args


# As if the installed transformers were outside the model code's range: its version check fails.
OUT_OF_RANGE = "import packaging.specifiers as s; s.SpecifierSet.__contains__ = lambda self, item: False; "
OURS = "[f for f in sys.meta_path if getattr(f, '__module__', type(f).__module__).startswith('llama_moe')]"


@pytest.mark.parametrize("first", ["import llama_moe_hf", "import transformers, llama_moe_hf"])
def test_importing_the_model_package_registers_the_families_and_does_nothing_else(first):
    """Before or after transformers: the Auto classes know the families, and no import hook is left behind."""
    code = (
        f"import sys; {first}; print({OURS}); "
        "from transformers import AutoConfig, AutoModelForTokenClassification as A; "
        "c = AutoConfig.for_model('attn_moe', vocab_size=16, hidden_size=8, intermediate_size=8, "
        "num_hidden_layers=1, num_attention_heads=2); print(type(A.from_config(c)).__name__)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["[]", "AttnMoEForTokenClassification"]


def test_the_tools_package_leaves_transformers_alone():
    """`import llama_moe` (the command line's package) imports neither torch nor the model code, and a later plain
    `import transformers` does not import the model code either: a transformers it refuses never breaks that."""
    code = (
        f"import sys; {OUT_OF_RANGE}import llama_moe, llama_moe.commands, llama_moe.conversion.registry; "
        f"print(sorted({{'torch', 'transformers', 'llama_moe_hf'}} & set(sys.modules)), {OURS}); "
        "import transformers, transformers.models.llama; print('llama_moe_hf' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["[] []", "False"]


def test_a_transformers_outside_the_range_gets_one_line_from_the_command(tmp_path):
    code = (
        f"import sys; {OUT_OF_RANGE}from llama_moe.commands import main; "
        "sys.exit(main(['convert', '--method', 'random', '--num-experts', '2', '--output', sys.argv[1]]))"
    )
    run = subprocess.run([sys.executable, "-c", code, tmp_path / "out"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("error: This model's code (llama-moe-hf ") and run.stderr.count("\n") == 1
    assert "needs transformers>=" in run.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_tensor_and_expert_parallel_plans_run_in_two_processes(tiny_dense, tmp_path):
    folder = convert_to_moe(
        tiny_dense[0], tmp_path / "moe", num_experts=4, num_shared_experts=2, moe_layers=["1"], progress=False
    ).output_dir
    script = Path(__file__).parents[1] / "scripts" / "parallel_script.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        str(folder),
        str(tmp_path / "result.json"),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    for layout, (difference, sharded) in json.loads((tmp_path / "result.json").read_text()).items():
        assert sharded and difference < 1e-5, layout


def test_one_version_for_the_package_its_metadata_and_the_model_code_folders_carry():
    import importlib.metadata

    from packaging.requirements import Requirement

    import llama_moe_hf
    from llama_moe_hf.modeling.configuration_llama_moe import LLAMA_MOE_VERSION, TRANSFORMERS_REQUIREMENT

    assert llama_moe_hf.__version__ == LLAMA_MOE_VERSION == importlib.metadata.version("llama-moe-hf")
    requirements = [Requirement(line) for line in importlib.metadata.requires("llama-moe-hf")]
    pin = next(r.specifier for r in requirements if r.name == "transformers")
    assert pin == Requirement(f"transformers{TRANSFORMERS_REQUIREMENT}").specifier


def test_the_readme_supported_models_table_is_the_registries():
    from llama_moe.supported import README, START, updated

    readme = README.read_text()
    assert START in readme
    assert updated(readme) == readme, "README.md's table is stale: run `python -m llama_moe.supported`"

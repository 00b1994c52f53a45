"""The way a recipe goes through `convert`: which functions receive it, in which modules, under which names.

Runs one conversion of the built-in default model (the `sparse-50` preset's settings at a few hundred calibration and
healing tokens of a local text, no joint stage, no check) with a profiler hook that notes every call into the
package's own code whose arguments hold the recipe (a `MoERecipe`, the one asked for or a completed copy). Prints the
calls, the distinct functions and modules, the calls into `conversion/plan.py`, and the argument names the recipe
travels under. Works on older trees of this repository too (the package was `llama_moe_hf` alone then), so the
figures before and after a redesign come from the same count:

    python benchmarks/structure/recipe_path.py
    git worktree add /tmp/before REV && PYTHONPATH=/tmp/before python benchmarks/structure/recipe_path.py
"""

import argparse
import collections
import sys
import tempfile
from pathlib import Path


def _convert_to_moe():
    from llama_moe_hf import convert_to_moe  # forwarded to `llama_moe` since the tools moved there

    return convert_to_moe


def _package_roots() -> list[str]:
    import importlib.util

    roots = []
    for name in ("llama_moe", "llama_moe_hf"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.append(str(Path(spec.submodule_search_locations[0]).resolve()))
    return roots


class RecipeTrace:
    """A `sys.setprofile` hook: each call into the package whose arguments hold a `MoERecipe`."""

    def __init__(self, roots: list[str]):
        self.roots = roots
        self.calls: list[tuple[str, str]] = []  # (module path, function name)
        self.names: collections.Counter = collections.Counter()

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        filename = frame.f_code.co_filename
        root = next((r for r in self.roots if filename.startswith(r)), None)
        if root is None:
            return
        code = frame.f_code
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        held = [name for name in arguments if type(frame.f_locals.get(name)).__name__ == "MoERecipe"]
        if held:
            module = str(Path(filename).relative_to(Path(root).parent))
            self.calls.append((module, code.co_qualname if hasattr(code, "co_qualname") else code.co_name))
            self.names.update(held)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print every call, in order")
    args = parser.parse_args()
    convert_to_moe = _convert_to_moe()
    trace = RecipeTrace(_package_roots())
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text(Path(__file__).read_text() * 40)  # a local text: no text the dense model makes
        settings = dict(
            method="residual",
            num_experts=6,
            num_shared_experts=2,
            top_k=2,
            router_init="linear_selector",
            calibration_data=str(text),
            calibration_tokens=512,
            calibration_samples=512,
            heal_tokens=512,
            joint_heal_tokens=0,
        )
        sys.setprofile(trace)
        try:
            convert_to_moe(None, str(Path(tmp) / "out"), eval=False, progress=False, **settings)
        finally:
            sys.setprofile(None)
    modules = collections.Counter(module for module, _ in trace.calls)
    plan_calls = sum(count for module, count in modules.items() if module.endswith("conversion/plan.py"))
    if args.list:
        for module, function in trace.calls:
            print(f"{module}:{function}")
    print(f"calls holding the recipe: {len(trace.calls)}")
    print(f"distinct functions: {len(set(trace.calls))}")
    print(f"modules: {len(modules)}")
    print(f"calls into conversion/plan.py: {plan_calls}")
    print(f"argument names: {len(trace.names)} ({', '.join(sorted(trace.names))})")


if __name__ == "__main__":
    main()

"""The `llama-moe` command's entry point.

It sits outside the `llama_moe_hf` package because importing the package registers the model families with
transformers, which imports torch (seconds): this module's presence tells the package to leave registration to the
commands that load a model, so that `llama-moe --help` and argument errors answer at once.
"""

import sys


def main(argv: list[str] | None = None) -> int:
    sys.modules.setdefault("llama_moe_cli", sys.modules[__name__])  # also when run as `python -m llama_moe_cli`
    from llama_moe_hf.commands import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())

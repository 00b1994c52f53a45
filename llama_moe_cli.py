"""The `llama-moe` command's entry point (`python -m llama_moe_cli` too). Importing `llama_moe_hf` costs nothing
until transformers is imported (it registers the model families then), so `llama-moe --help` and argument errors
answer at once."""

import sys


def main(argv: list[str] | None = None) -> int:
    from llama_moe_hf.commands import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())

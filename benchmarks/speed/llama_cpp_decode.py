"""llama.cpp decoding speed of the built-in SmolLM2 and its expert splits, all written by `llama-moe export`.

The dense model and its 2/8, 4/8 and 6/8 splits (`convert_to_moe`, random split; `--top-k`, `--num-experts`), and/or
`--presets`' layouts (shared experts: GGUF architecture "ernie4_5-moe"; built as `bench_decode.preset_model` builds
them, the speed of a layout not depending on how well its weights were chosen), are exported through the same GGUF
writer at F16 and at Q8_0 (`--outtype q8_0`), then decoded by llama.cpp through llama-cpp-python (2 threads,
batch 1, greedy argmax of the logits, 48 tokens after a chat prompt), the models interleaved round by round; the
median of the rounds per model. Each figure is also given against the model's bandwidth limit: the weight bytes a
decoding step reads (every tensor of the file, but k of the n experts of the expert tensors and one row of the
token embedding when the output matrix is separate) over a copy bandwidth measured in the same process
(`benchmarks.common.copy_bandwidth`: torch's copy on `--threads` threads).

llama-cpp-python builds llama.cpp from source: install it in the benchmark's own environment, never for CI.

    pip install llama-cpp-python==0.3.36
    python benchmarks/speed/llama_cpp_decode.py                        # F16 and Q8_0, 5 rounds
    python benchmarks/speed/llama_cpp_decode.py --outtypes f16 --top-k 2 --rounds 9
    python benchmarks/speed/llama_cpp_decode.py --presets sparse-25 sparse-50 sparse-75   # rows to presets.jsonl
    python benchmarks/speed/llama_cpp_decode.py --outtypes f16 --top-k 2 4 6 8    # 8/8: the dense work, expert path
    python benchmarks/speed/llama_cpp_decode.py --outtypes f16 --presets sparse-25 --folders outputs/presets/sparse-25

`--folders` adds converted folders as they are (healed weights, trained routers) beside the built layouts, rows named
`folder:NAME`. For every MoE model the script also prints how its router spreads the decoded tokens (in transformers,
the 48 greedy tokens of the chat prompt): the experts each layer uses over them, and how often a token takes the same
experts as the token before it. A router that keeps choosing the same experts reads fewer distinct bytes than the
weights' sizes say, so the cache could serve part of them; the built layouts' routers are barely trained.

Prefill: the 512-token prompt evaluated in one call, tokens/s, the same rounds.

Under the table, per type, a least-squares line through the models' decoding steps: milliseconds per token =
fixed + MB read / bandwidth. The fixed part (the work that does not shrink with the weights read: attention, norms,
the graph's scheduling) caps what reading fewer weights can gain, the more so the faster the memory: a model reading
a share s of the dense bytes decodes at most (fixed + dense read time) / (fixed + s * dense read time) as fast.

`--repack auto` (the default) turns llama.cpp's weight repacking off (its extra buffer types, the CLI's `--no-repack`)
for Q8_0 files where llama.cpp reports AMX_INT8: there llama.cpp 0.3.36 put the Q8_0 weights in its AMX buffer and
crashed (segmentation fault) on the first evaluation, the dense model's file as well
(benchmarks/reports/preset-serving-speed.md). Rows say whether repacking was on.
"""

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import RESULTS, copy_bandwidth, record

PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to program computers."}]


def exported_models(
    tmp: Path, top_ks: list[int], outtypes: list[str], presets: list[str], num_experts: int = 8, extra=()
) -> tuple[dict[str, Path], dict[str, Path]]:
    """({'dense F16', '2/8 Q8_0', 'sparse-25 F16', 'folder:NAME F16', ...: the GGUF file}, {name: the folder})."""
    from llama_moe.checkpoints import default_model_path
    from llama_moe.export import export_model
    from llama_moe_hf import convert_to_moe

    folders = {"dense": Path(default_model_path())}
    for k in top_ks:
        moe = convert_to_moe(None, tmp / f"moe{k}", num_experts=num_experts, top_k=k, progress=False)
        folders[f"{k}/{num_experts}"] = moe.output_dir
    if presets:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from benchmarks.speed.bench_decode import preset_model

        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        dense = AutoModelForCausalLM.from_pretrained(default_model_path())
        for name in presets:
            preset_model(name, dense, tokenizer).save_pretrained(tmp / name)
            tokenizer.save_pretrained(tmp / name)
            folders[name] = tmp / name
    folders |= {f"folder:{Path(folder).name}": Path(folder) for folder in extra}
    files = {}
    for name, folder in folders.items():
        for outtype in outtypes:
            options = {"dtype": "float16"} if outtype == "f16" else {"outtype": "q8_0"}
            result = export_model(folder, "gguf", tmp / f"{name.replace('/', '-')}-{outtype}", progress=False,
                                  tokenizer_pre="smollm", **options)  # fmt: skip
            files[f"{name} {outtype.upper()}"] = result.output_dir / result.files[0]
    return files, folders


def routing_spread(folder: Path, prompt_ids: list[int], new_tokens: int) -> tuple[float, float, int] | None:
    """(experts each MoE layer uses over the greedy tokens, averaged over layers; share of (token, layer) pairs
    choosing the same experts as the token before; the experts a layer has), or None for a dense model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    if not gates:
        return None
    prompt = torch.tensor([prompt_ids])
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        chosen = []  # per layer: [T, k] expert indices
        hooks = [gate.register_forward_hook(lambda m, a, out: chosen.append(out[2])) for gate in gates]
        model(ids)
        for hook in hooks:
            hook.remove()
    decoded = [index[len(prompt_ids) :].sort(-1).values for index in chosen]  # the timed steps' tokens
    used = statistics.mean(index.unique().numel() for index in decoded)
    same = statistics.mean((index[1:] == index[:-1]).all(-1).float().mean().item() for index in decoded)
    return used, same, gates[0].weight.shape[0]


def print_routing_spreads(folders: dict[str, Path], prompt_ids: list[int], new_tokens: int) -> None:
    for name, folder in folders.items():
        spread = routing_spread(folder, prompt_ids, new_tokens)
        if spread:
            print(f"{name}: over {new_tokens} greedy tokens each MoE layer used {spread[0]:.1f} of its "
                  f"{spread[2]} routed experts (mean of layers); {spread[1]:.0%} of tokens took the same experts as "
                  "the token before")  # fmt: skip


def read_bytes_per_token(gguf_file: Path) -> int:
    """Bytes of the weights one decoding step reads (see the module)."""
    import gguf

    reader = gguf.GGUFReader(gguf_file)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    arch = fields["general.architecture"]  # shared experts ("_shexp.") are read whole, as dense tensors are
    share = fields.get(f"{arch}.expert_used_count", 1) / fields.get(f"{arch}.expert_count", 1)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    total = 0
    for tensor in reader.tensors:
        size = int(tensor.n_bytes)
        if "_exps." in tensor.name:
            size = int(size * share)
        elif tensor.name == "token_embd.weight" and not tied:
            size //= int(tensor.shape[-1])  # one row of [V, H] (GGUF lists H first)
        total += size
    return total


def decode_rate(llm, prompt_ids: list[int], new_tokens: int) -> tuple[float, float]:
    """Tokens/s of greedy decoding after the prompt (the prompt's evaluation is not timed), and llama.cpp's own
    count of its decoding time per token (ms; `llama_perf_context`, which leaves out the Python around it)."""
    import llama_cpp

    llm.reset()
    llm.eval(prompt_ids)
    llama_cpp.llama_perf_context_reset(llm.ctx)
    start = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    elapsed = time.perf_counter() - start
    perf = llama_cpp.llama_perf_context(llm.ctx)
    return new_tokens / elapsed, perf.t_eval_ms / max(perf.n_eval, 1)


def prefill_rate(llm, prompt_ids: list[int]) -> float:
    """Tokens/s of evaluating `prompt_ids` in one call, from an empty cache."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt_ids)
    return len(prompt_ids) / (time.perf_counter() - start)


def repacking(choice: str, outtypes: list[str]) -> bool:
    """Whether llama.cpp repacks weights into its extra buffer types (see the module): `--repack`'s choice."""
    import llama_cpp

    if choice != "auto":
        return choice == "on"
    return not ("q8_0" in outtypes and "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode())


@contextlib.contextmanager
def model_params(repack: bool):
    """llama-cpp-python's `Llama` takes no `use_extra_bufts`: set it in the defaults its constructor reads."""
    import llama_cpp.llama_cpp as native

    defaults = native.llama_model_default_params

    def params():
        value = defaults()
        value.use_extra_bufts = repack
        return value

    native.llama_model_default_params = params
    try:
        yield
    finally:
        native.llama_model_default_params = defaults


def load_models(files: dict[str, Path], threads: int, repack: bool) -> dict:
    """Each GGUF file in llama.cpp (`llama_cpp.Llama`), name -> model."""
    import llama_cpp

    with model_params(repack):
        return {
            name: llama_cpp.Llama(str(path), n_ctx=1024, n_threads=threads, logits_all=True, verbose=False)
            for name, path in files.items()
        }


def print_fixed_cost_fits(rates: dict[str, list[float]], step_bytes: dict[str, int]) -> None:
    """Per type with 3 models or more, the least-squares `ms per token = fixed + MB / bandwidth` through the models'
    median rates."""
    for outtype in sorted({name.split()[-1] for name in rates}):
        names = [name for name in rates if name.split()[-1] == outtype]
        if len(names) < 3:  # two points fit any line
            continue
        megabytes = np.array([step_bytes[name] / 1e6 for name in names])
        ms = np.array([1e3 / statistics.median(rates[name]) for name in names])
        slope, fixed = np.polyfit(megabytes, ms, 1)
        worst = np.abs(ms - (fixed + slope * megabytes)).max()
        print(f"{outtype}: ms per token = {fixed:.2f} + MB read / {1 / slope:.1f} GB/s (least squares over "
              f"{len(names)} models, largest residual {worst:.2f} ms)")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top-k", type=int, nargs="+", help="splits k/n (default 2 4 6; none with --presets)")
    parser.add_argument("--num-experts", type=int, default=8, help="of the splits (k/n); n/n does the dense FLOPs")
    parser.add_argument("--outtypes", nargs="+", default=["f16", "q8_0"], choices=["f16", "q8_0"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--presets", nargs="+", default=[], help="presets' layouts instead of the splits")
    parser.add_argument("--folders", nargs="+", default=[], help="converted folders as they are, beside the rest")
    parser.add_argument("--repack", choices=["auto", "on", "off"], default="auto", help="llama.cpp's weight repacking")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import llama_cpp
    import torch
    from transformers import AutoTokenizer

    from llama_moe.checkpoints import default_model_path

    torch.set_num_threads(args.threads)  # the copy bandwidth's threads, as llama.cpp's
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
    with tempfile.TemporaryDirectory() as tmp:
        top_ks = args.top_k or ([] if args.presets or args.folders else [2, 4, 6])
        files, folders = exported_models(Path(tmp), top_ks, args.outtypes, args.presets, args.num_experts, args.folders)
        repack = repacking(args.repack, args.outtypes)
        models = load_models(files, args.threads, repack)
        step_bytes = {name: read_bytes_per_token(path) for name, path in files.items()}
        bandwidth = copy_bandwidth()
        rates, own_ms, prefill = ({name: [] for name in models} for _ in range(3))
        long_prompt = (prompt_ids * (512 // len(prompt_ids) + 1))[:512]
        for round_idx in range(args.rounds + 1):  # the first round warms up
            for name, llm in models.items():
                rate, ms = decode_rate(llm, prompt_ids, args.new_tokens)
                filled = prefill_rate(llm, long_prompt)
                if round_idx:
                    rates[name].append(rate)
                    own_ms[name].append(ms)
                    prefill[name].append(filled)
        print_routing_spreads(folders, prompt_ids, args.new_tokens)
    print(f"llama-cpp-python {llama_cpp.__version__}, {args.threads} threads, {args.new_tokens} greedy tokens, "
          f"median of {args.rounds} interleaved rounds; weight repacking {'on' if repack else 'off'}; copy "
          f"bandwidth {bandwidth:.1f} GB/s")  # fmt: skip
    print("| model | weight MB read per token | limit tokens/s | decode tokens/s | vs dense (same type) | limit vs "
          "dense | share of limit | llama.cpp's eval ms/token | 512-token prefill tokens/s | vs dense |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, values in rates.items():
        rate, outtype = statistics.median(values), name.split()[-1]
        dense = statistics.median(rates[f"dense {outtype}"])
        limit = bandwidth * 1e9 / step_bytes[name]
        limit_ratio = step_bytes[f"dense {outtype}"] / step_bytes[name]
        filled, dense_filled = statistics.median(prefill[name]), statistics.median(prefill[f"dense {outtype}"])
        print(f"| {name} | {step_bytes[name] / 1e6:.0f} | {limit:.1f} | {rate:.1f} | {rate / dense:.2f}x | "
              f"{limit_ratio:.2f}x | {rate / limit:.0%} | {statistics.median(own_ms[name]):.2f} | {filled:.0f} | "
              f"{filled / dense_filled:.2f}x |")  # fmt: skip
        if name.split()[0] in args.presets:
            row = {"kind": "speed", "preset": name.split()[0], "runtime": f"llama.cpp {outtype}"}
            row |= {"decode_ratio": round(rate / dense, 3), "limit_ratio": round(limit_ratio, 3)}
            row |= {"prefill_ratio": round(filled / dense_filled, 3), "threads": args.threads, "repack": repack}
            record("presets", row, RESULTS / "presets.jsonl")
    print_fixed_cost_fits(rates, step_bytes)


if __name__ == "__main__":
    main()

"""Where users feel MoE speed: greedy decoding tokens/s and 512-token prefill, the default model against its MoE split.

The dense SmolLM2-135M-Instruct and the same model split into 8 experts with top-2 routing (`build_moe`, random
split, random router) run side by side in each process, interleaved round by round so that machine load falls on
both alike. Batch 1, float32, greedy, a chat prompt. Decoding: `generate` with a fixed number of new tokens, timed
whole (the prompt's prefill included) and from its first new token on (the decoding steps alone, as llama.cpp's "eval"
counts them; a streamer notes when each token comes).
Prefill: one forward of 512 tokens with a cache, keeping the last token's logits (what `generate` does first).
`--profile` also times one decoding step by module: attention, MLP (for the MoE model also its router and experts
inside it), norms, LM head, and the rest (embedding, rotary, masks, cache bookkeeping, Python between modules).
With `--compile` (CPU) it splits a compiled step by what runs instead, from torch.profiler over `generate`: inductor's
generated kernels, aten calls (external kernels such as attention and top-k, and allocations), Dynamo's guard checks
before each call, the Python of the compiled graph's wrapper that launches its kernels, and the rest (`generate`'s
own Python and what the profiler does not see), over the steps after the prefill.

In float32 on CPU every model's linear layers run on every thread where that pays (`llama_moe.lm_head`: in eager
mode the LM head through oneDNN, as `llama-moe chat` runs it; compiled, every `Linear` at one row as an inductor
reduction, `use_threaded_linears`): torch's own float32 matrix-vector product uses one thread. `--threaded lm-head`
threads the LM head alone (the setting of earlier tables), `--threaded none` times torch's products throughout.

`--compile` runs both models the documented transformers way: `torch.compile(model.forward, fullgraph=True)` and
`generate(..., cache_implementation="static")` (compiled once before the timed rounds); on a GPU `generate` compiles
the forward itself for a static cache, with `CompileConfig(fullgraph=True, mode=--compile-mode)`. Each model's
tokens/s is also given against its own memory-bandwidth limit: a copy bandwidth measured in the same process divided
by the weight bytes one decoding step reads (every weight, except that only k of the N routed experts count and the
embedding lookup reads one row; a tied LM head reads the whole matrix).

Timings on a shared VM can be bimodal across processes (docs/benchmarks.md): `--processes N` repeats the whole
measurement in N fresh processes and reports the median ratio and the spread.

    python benchmarks/speed/bench_decode.py                          # 3 processes, 2 threads
    python benchmarks/speed/bench_decode.py --processes 1 --profile
    python benchmarks/speed/bench_decode.py --threaded none          # torch's one-thread products (no llama_moe.lm_head)
    python benchmarks/speed/bench_decode.py --compile --top-k 2 4 6  # compiled, 2/8, 4/8 and 6/8 splits in one table
    python benchmarks/speed/bench_decode.py --compile --profile      # and where a compiled step goes
    python benchmarks/speed/bench_decode.py --presets sparse-25 sparse-50 sparse-75 g-moefication   # presets' layouts
    python benchmarks/speed/bench_decode.py --device cuda --dtype bfloat16 --compile --compile-mode reduce-overhead
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import RESULTS, copy_bandwidth, interleaved_times, medians, record, synchronizer


def load_models(args) -> tuple[dict, object]:
    """({name: model}, tokenizer): the dense default model and its splits (or presets' layouts), in `--dtype` on `--device`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llama_moe.checkpoints import default_model_path
    from llama_moe.lm_head import use_threaded_linears, use_threaded_lm_head
    from llama_moe_hf import build_moe

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # split in float32, then cast
    if args.presets:
        models = {"dense": dense, **{name: preset_model(name, dense, tokenizer) for name in args.presets}}
    else:
        models = {"dense": dense}
        for k in args.top_k:
            models[f"{k}/{args.num_experts}"] = build_moe(dense, num_experts=args.num_experts, top_k=k)
    for name, model in models.items():
        models[name] = model.to(device=args.device, dtype=getattr(torch, args.dtype))
        if name != "dense" and args.experts_implementation:
            model.set_experts_implementation(args.experts_implementation)
        if threaded(args) == "all" and args.compile:  # every model alike
            use_threaded_linears(model)
        elif threaded(args) != "none":  # eager: the head alone pays, as `llama-moe chat` runs it
            use_threaded_lm_head(model)
    return models, tokenizer


class Tasks:
    """What is timed: greedy decoding of a chat prompt, and a prefill of random tokens."""

    def __init__(self, args, tokenizer, vocab_size: int):
        import torch
        from transformers.generation import CompileConfig

        self.args = args
        self.generate_kwargs = {"cache_implementation": "static"} if args.compile else {}
        if args.compile and args.device != "cpu":  # there generate compiles the forward itself for a static cache
            self.generate_kwargs["compile_config"] = CompileConfig(fullgraph=True, mode=args.compile_mode)
        messages = [{"role": "user", "content": "Write a long story about a dragon who learns to program computers."}]
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        self.prompt = prompt.to(args.device)
        long_input = torch.randint(0, vocab_size, (1, args.prefill_tokens), generator=torch.Generator())
        self.long_input = long_input.to(args.device)

    def greedy_tokens(self, model, **kwargs):  # the first call of a compiled model compiles it
        new = {"max_new_tokens": self.args.new_tokens, "min_new_tokens": self.args.new_tokens}
        return model.generate(**self.prompt, **new, do_sample=False, **kwargs)

    def decode(self, model):  # new tokens, and tokens/s after the first
        clock = TokenClock()
        self.greedy_tokens(model, streamer=clock, **self.generate_kwargs)
        return self.args.new_tokens, clock.step_rate()

    def prefill(self, model):
        model(input_ids=self.long_input, logits_to_keep=1, use_cache=True)
        return self.args.prefill_tokens, None


def compile_models(models: dict, tasks: Tasks, args) -> dict:
    """Compile each model (CPU: its forward; GPU: `generate` does) and say whether its greedy tokens equal eager's."""
    import torch

    equal = {}
    for name, model in models.items():
        eager_tokens = tasks.greedy_tokens(model)  # a dynamic cache, never compiled
        if args.device == "cpu":
            model.forward = torch.compile(model.forward, fullgraph=True, mode=args.compile_mode)
        compiled_tokens = tasks.greedy_tokens(model, **tasks.generate_kwargs)
        equal[name] = torch.equal(compiled_tokens, eager_tokens)
    return equal


def time_task(task, models: dict, args) -> tuple[dict, dict]:
    """Median tokens/s of `task` per model, and of its steps after the first token, models interleaved by round."""
    step_rates = {name: [] for name in models}

    def call(name, model):
        return lambda: step_rates[name].append(task(model))

    sync = synchronizer(args.device)
    calls = {name: call(name, model) for name, model in models.items()}
    seconds = interleaved_times(calls, args.rounds, args.warmup, synchronize=sync)
    tokens = {name: values[0][0] for name, values in step_rates.items()}
    rates = {name: [tokens[name] / s for s in values] for name, values in seconds.items()}
    steps = {
        name: [rate for _, rate in values[args.warmup :] if rate is not None] for name, values in step_rates.items()
    }
    return medians(rates), medians({name: values for name, values in steps.items() if values})  # prefill has no steps


def measure(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    models, tokenizer = load_models(args)
    step_bytes = {name: read_bytes_per_token(model) for name, model in models.items()}
    tasks = Tasks(args, tokenizer, models["dense"].config.vocab_size)
    results = {"copy_gb_s": copy_bandwidth(args.device), "step_bytes": step_bytes}
    if args.profile and args.compile:  # name inductor's kernels in the profile (set before anything compiles)
        torch._inductor.config.cpp.enable_kernel_profile = True
    with torch.inference_mode():
        if args.compile:
            results["compiled_equals_eager"] = compile_models(models, tasks, args)
        results["decode"], results["decode_steps"] = time_task(tasks.decode, models, args)
        if not args.compile:
            results["prefill"], _ = time_task(tasks.prefill, models, args)
        if args.profile:
            results["profile_ms"] = profiles(models, tasks, args)
    return results


def profiles(models: dict, tasks: Tasks, args) -> dict:
    """{model: ms per decoding step by module kind} (compiled: by what runs, from torch.profiler)."""
    import torch

    if not args.compile:
        return {name: step_profile(model, tasks.prompt["input_ids"]) for name, model in models.items()}
    with torch.compiler.set_stance("fail_on_recompile"):  # the graphs of the timed rounds, no other
        return {
            name: compiled_step_profile(
                lambda streamer, model=model: tasks.greedy_tokens(model, streamer=streamer, **tasks.generate_kwargs)
            )
            for name, model in models.items()
        }


def run_worker(command: list[str]) -> dict:
    """One measuring process's results; its error output is shown if it fails."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"a measuring process failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def threaded(args) -> str:
    """Which linear layers run on every thread (llama_moe.lm_head): only ever float32 on CPU."""
    cpu_float32 = args.device == "cpu" and args.dtype == "float32"
    return args.threaded if cpu_float32 else "none"


def read_bytes_per_token(model) -> int:
    """Weight bytes one decoding step reads: every parameter once (the tied LM head is the embedding), but of each
    routed-experts tensor only the k of N experts a token selects, and one row of an untied input embedding."""
    total = 0
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    for name, parameter in model.named_parameters():
        size = parameter.numel() * parameter.element_size()
        if parameter is embedding and not tied:
            size = parameter.shape[-1] * parameter.element_size()
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            size = size * model.config.num_experts_per_tok // model.config.num_experts
        total += size
    return total


def preset_model(name: str, dense, tokenizer):
    """A model with preset `name`'s layout (experts, shared experts, top-k, router, compensation), calibrated on 4096
    tokens (16 sequences: enough to group), its selector barely trained and not healed, layer-wise or jointly: the
    speed of a layout does not depend on how well its weights were chosen."""
    from llama_moe.conversion.recipe import load_recipe, preset_path
    from llama_moe_hf import build_moe

    recipe, _ = load_recipe(preset_path(name))
    fast = dict(calibration_tokens=4096, calibration_samples=4096, heal_tokens=0, joint_heal_tokens=0)  # 16 sequences
    if recipe.router_init in ("selector", "linear_selector"):
        fast[f"{recipe.router_init}_steps"] = 1
    return build_moe(dense, recipe, tokenizer=tokenizer, **fast)


def step_profile(model, input_ids, steps: int = 30) -> dict:
    """Milliseconds per decoding step by module kind, from forward hooks (which add a little time themselves)."""
    import collections

    from transformers import DynamicCache

    from llama_moe_hf.modeling.cache_compat import CACHE_ARG  # the dense model takes the same name

    spent, started = collections.defaultdict(float), {}

    def timed(kind, module):
        module.register_forward_pre_hook(lambda m, a: started.__setitem__(id(m), time.perf_counter()))
        module.register_forward_hook(
            lambda m, a, o: spent.__setitem__(kind, spent[kind] + time.perf_counter() - started[id(m)])
        )

    for layer in model.model.layers:
        timed("attention", layer.self_attn)
        timed("mlp", layer.mlp)
        timed("norms", layer.input_layernorm)
        timed("norms", layer.post_attention_layernorm)
        if hasattr(layer.mlp, "gate"):  # inside the MoE block (not added to the total again)
            timed("mlp: router", layer.mlp.gate)
            timed("mlp: experts", layer.mlp.experts)
    timed("lm_head", model.lm_head)
    cache = DynamicCache(config=model.config)
    token = model(input_ids=input_ids, **{CACHE_ARG: cache}, use_cache=True).logits[:, -1:].argmax(-1)
    spent.clear()
    start = time.perf_counter()
    for _ in range(steps):
        token = model(input_ids=token, **{CACHE_ARG: cache}, use_cache=True).logits[:, -1:].argmax(-1)
    total = (time.perf_counter() - start) / steps * 1e3
    profile = {kind: value / steps * 1e3 for kind, value in spent.items()}
    profile["rest"] = total - sum(value for kind, value in profile.items() if not kind.startswith("mlp:"))
    profile["step"] = total
    return profile


class TokenClock:
    """A `generate` streamer that notes when each token comes: `put` gets the prompt, then each new token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def step_rate(self) -> float:
        """Tokens/s after the first new token: the decoding steps alone, without the prefill."""
        return (len(self.times) - 2) / (self.times[-1] - self.times[1])


def compiled_step_profile(generate) -> dict:
    """Milliseconds per compiled decoding step by what runs (module docstring), from torch.profiler's self times over
    `generate(streamer)` from its first new token on: every step after the prefill."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    class AfterPrefill(TokenClock):
        def __init__(self):
            super().__init__()
            self.profiler = profile(activities=[ProfilerActivity.CPU])

        def put(self, value):
            super().put(value)
            if len(self.times) == 2:  # the first new token: the prefill is done
                self.profiler.start()

        def end(self):
            self.profiler.stop()
            self.wall_ms = (time.perf_counter() - self.times[1]) * 1e3

    def kind(name: str) -> str:
        if name.startswith("graph_"):  # inductor's kernels, named by `cpp.enable_kernel_profile`
            return "generated kernels"
        if name.startswith("aten::"):
            return "aten calls"
        if name == "TorchDynamo Cache Lookup":
            return "guards"
        return "graph wrapper" if name.startswith("## Call CompiledFxGraph") else "other profiled"

    streamer = AfterPrefill()
    generate(streamer)
    spent = collections.Counter()
    for event in streamer.profiler.key_averages():
        spent[kind(event.key)] += event.self_cpu_time_total / 1e3
    spent["rest"] = streamer.wall_ms - sum(spent.values())
    spent["step"] = streamer.wall_ms
    return {name: ms / (len(streamer.times) - 2) for name, ms in spent.items()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, nargs="+", default=[2], help="one MoE split per value")
    parser.add_argument("--presets", nargs="+", help="time these presets' layouts against dense instead of a split")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--profile", action="store_true",
        help="also time one decoding step by module kind (with --compile: by generated kernels, guards and wrapper)",
    )  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="torch.compile the forward, static cache")
    parser.add_argument(
        "--compile-mode", default="default", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
        help="torch.compile's mode (reduce-overhead: CUDA graphs, the GPU's setting for batch-1 decoding)",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", help="e.g. cuda (benchmarks/gpu/gpu_check.py's machine)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--experts-implementation", help="the MoE models' experts kernel (default: the model's own)")
    parser.add_argument(
        "--threaded",
        default="all",
        choices=["all", "lm-head", "none"],
        help="float32 on CPU: which linear layers run on every thread (all: use_threaded_linears compiled, the LM "
        "head eager)",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="append the bandwidth table's rows to benchmarks/results/decode.jsonl (--presets always appends each "
        "preset's ratios to benchmarks/results/presets.jsonl)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile and args.compile and args.device != "cpu":
        parser.error("--profile with --compile splits a CPU step (kernels run asynchronously on a GPU)")
    return args


def main():
    args = parse_args()
    if args.worker:
        print(json.dumps(measure(args)))
        return
    worker = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    runs = [run_worker(worker) for _ in range(args.processes)]
    import torch

    compared = args.presets or [f"{k}/{args.num_experts}" for k in args.top_k]
    mode = f"compiled forward ({args.compile_mode}), static cache" if args.compile else "eager"
    experts = args.experts_implementation or "default experts"
    print(
        f"torch {torch.__version__}, {args.device}, threads={args.threads}, {args.dtype}, batch 1, {mode}, {experts}, "
        f"threaded linears: {threaded(args)} "
        f"| SmolLM2-135M-Instruct "
        f"dense vs {', '.join(compared)} | {args.processes} processes x {args.rounds} rounds"
    )
    rows = print_bandwidth_table(runs, ["dense", *compared])
    if args.record:  # docs/benchmarks.md's "decode" table is the eager CPU one
        table = "decode" if not args.compile and args.device == "cpu" else f"decode_{args.device}_{mode.split()[0]}"
        for row in rows:
            record("decode", {"table": table, **row})
    if args.compile:
        equal = [run["compiled_equals_eager"] for run in runs]
        print("compiled greedy tokens equal the eager model's (static cache), per process:", equal)
    print_ratios(runs, compared, args)
    if args.presets:  # the figures `llama-moe convert --help` shows
        record_presets(runs, args)
    for run in runs if args.profile else []:
        for model, profile in run["profile_ms"].items():
            print(f"  {model} step: " + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in profile.items()))
        if args.compile:
            print_kernel_ratio(run["profile_ms"], compared)


def record_presets(runs: list[dict], args) -> None:
    """Each preset's median decode (and prefill, eager) ratio to dense, to benchmarks/results/presets.jsonl."""
    runtime = f"transformers {'compiled' if args.compile else 'eager'}, {args.device} {args.dtype}"
    for name in args.presets:
        row = {"kind": "speed", "preset": name, "runtime": runtime, "threads": args.threads}
        for task in ("decode", "prefill"):
            if task in runs[0]:
                row[f"{task}_ratio"] = round(statistics.median(run[task][name] / run[task]["dense"] for run in runs), 3)
        record("presets", row, RESULTS / "presets.jsonl")


def print_ratios(runs: list[dict], compared: list[str], args) -> None:
    """Each split's tokens/s against dense, per process, with the median ratio and its range."""
    timed = (
        ("decode", f"{args.new_tokens} new tokens"),
        ("decode_steps", "the steps after the first new token"),
        ("prefill", f"{args.prefill_tokens} tokens"),
    )
    for task, unit in timed:
        for name in compared if task in runs[0] else []:  # compiled runs time decoding only
            ratios = [run[task][name] / run[task]["dense"] for run in runs]
            cells = ", ".join(f"{run[task]['dense']:.1f} / {run[task][name]:.1f}" for run in runs)
            print(f"{task} ({unit}), tokens/s dense / {name} per process: {cells}")
            print(f"  {name} / dense: median {statistics.median(ratios):.2f}x, "
                  f"range {min(ratios):.2f}-{max(ratios):.2f}x")  # fmt: skip


def print_kernel_ratio(profile_ms: dict, compared: list[str]) -> None:
    """A compiled step's kernels (generated and aten) apart from the time around them, MoE against dense."""
    kernels = {name: ms["generated kernels"] + ms["aten calls"] for name, ms in profile_ms.items()}
    for name in compared:
        around = {model: profile_ms[model]["step"] - kernels[model] for model in ("dense", name)}
        ratio = kernels["dense"] / kernels[name]
        print(f"  kernels dense / {name}: {kernels['dense']:.2f} / {kernels[name]:.2f} ms = {ratio:.2f}x; "
              f"around them {around['dense']:.2f} / {around[name]:.2f} ms")  # fmt: skip


def print_bandwidth_table(runs: list[dict], names: list[str]) -> list[dict]:
    """Median decode tokens/s per model (all of `generate`, and its steps after the first new token), the ratios to
    dense, and the share of its bandwidth limit it reaches; returned as rows (the columns of tables.py's "decode")."""
    bandwidth = statistics.median(run["copy_gb_s"] for run in runs)
    print(f"copy bandwidth {bandwidth:.1f} GB/s (median of the processes)")
    print(
        "| model | weight MB read per token | limit tokens/s | decode tokens/s | vs dense | share of limit "
        "| after the first token, tokens/s | vs dense |"
    )
    print("|---|---|---|---|---|---|---|---|")
    dense, dense_steps = (statistics.median(run[task]["dense"] for run in runs) for task in ("decode", "decode_steps"))
    rows = []
    for name in names:
        rate, steps = (statistics.median(run[task][name] for run in runs) for task in ("decode", "decode_steps"))
        megabytes = runs[0]["step_bytes"][name] / 1e6
        limit = bandwidth * 1e3 / megabytes
        print(
            f"| {name} | {megabytes:.0f} | {limit:.1f} | {rate:.1f} | {rate / dense:.2f}x | {rate / limit:.0%} "
            f"| {steps:.1f} | {steps / dense_steps:.2f}x |"
        )
        rows.append(
            {"model": name, "weight_mb_read_per_token": round(megabytes), "limit_tokens_s": round(limit, 1)}
            | {"decode_tokens_s": round(rate, 1), "vs_dense": round(rate / dense, 2)}
            | {"share_of_limit": round(100 * rate / limit), "after_first_tokens_s": round(steps, 1)}
            | {"copy_gb_s": round(bandwidth, 1), "processes": len(runs)}
        )
    return rows


if __name__ == "__main__":
    main()

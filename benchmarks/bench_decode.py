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

In float32 on CPU every model's linear layers run on every thread where that pays (`llama_moe_hf.lm_head`: in eager
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

    python benchmarks/bench_decode.py                          # 3 processes, 2 threads
    python benchmarks/bench_decode.py --processes 1 --profile
    python benchmarks/bench_decode.py --threaded none          # torch's one-thread products (no llama_moe_hf.lm_head)
    python benchmarks/bench_decode.py --compile --top-k 2 4 6  # compiled, 2/8, 4/8 and 6/8 splits in one table
    python benchmarks/bench_decode.py --compile --profile      # and where a compiled step goes
    python benchmarks/bench_decode.py --presets sparse-25 sparse-50 sparse-75 g-moefication   # presets' layouts
    python benchmarks/bench_decode.py --device cuda --dtype bfloat16 --compile --compile-mode reduce-overhead
"""

import argparse
import json
import statistics
import subprocess
import sys
import time


def measure(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation import CompileConfig

    from llama_moe_hf import build_moe
    from llama_moe_hf.checkpoints import default_model_path
    from llama_moe_hf.lm_head import use_threaded_linears, use_threaded_lm_head

    torch.set_num_threads(args.threads)
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
    step_bytes = {name: read_bytes_per_token(model) for name, model in models.items()}
    generate_kwargs = {"cache_implementation": "static"} if args.compile else {}
    if args.compile and args.device != "cpu":  # there generate compiles the forward itself for a static cache
        generate_kwargs["compile_config"] = CompileConfig(fullgraph=True, mode=args.compile_mode)
    messages = [{"role": "user", "content": "Write a long story about a dragon who learns to program computers."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = prompt.to(args.device)
    long_input = torch.randint(0, dense.config.vocab_size, (1, args.prefill_tokens), generator=torch.Generator())
    long_input = long_input.to(args.device)
    synchronize = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def greedy_tokens(model, **kwargs):  # the first call of a compiled model compiles it
        new = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
        return model.generate(**prompt, **new, do_sample=False, **kwargs)

    def decode(model):  # new tokens, and tokens/s after the first
        clock = TokenClock()
        greedy_tokens(model, streamer=clock, **generate_kwargs)
        return args.new_tokens, clock.step_rate()

    def prefill(model):
        model(input_ids=long_input, logits_to_keep=1, use_cache=True)
        return args.prefill_tokens, None

    results = {"copy_gb_s": copy_bandwidth(args.device, synchronize), "step_bytes": step_bytes}
    if args.profile and args.compile:  # name inductor's kernels in the profile (set before anything compiles)
        torch._inductor.config.cpp.enable_kernel_profile = True
    with torch.inference_mode():
        for name, model in models.items() if args.compile else ():
            eager_tokens = greedy_tokens(model)  # a dynamic cache, never compiled
            if args.device == "cpu":
                model.forward = torch.compile(model.forward, fullgraph=True, mode=args.compile_mode)
            compiled_tokens = greedy_tokens(model, **generate_kwargs)
            results.setdefault("compiled_equals_eager", {})[name] = torch.equal(compiled_tokens, eager_tokens)
        tasks = (("decode", decode),) if args.compile else (("decode", decode), ("prefill", prefill))
        for name, task in tasks:
            rates, step_rates = {model: [] for model in models}, {model: [] for model in models}
            for round_idx in range(args.warmup + args.rounds):
                for model_name, model in models.items():
                    synchronize()
                    start = time.perf_counter()
                    tokens, step_rate = task(model)
                    synchronize()
                    if round_idx >= args.warmup:
                        rates[model_name].append(tokens / (time.perf_counter() - start))
                        step_rates[model_name].append(step_rate)
            results[name] = {model: statistics.median(values) for model, values in rates.items()}
            if name == "decode":
                results["decode_steps"] = {model: statistics.median(values) for model, values in step_rates.items()}
        if args.profile and args.compile:
            with torch.compiler.set_stance("fail_on_recompile"):  # the graphs of the timed rounds, no other
                results["profile_ms"] = {
                    name: compiled_step_profile(
                        lambda streamer: greedy_tokens(model, streamer=streamer, **generate_kwargs)
                    )
                    for name, model in models.items()
                }
        elif args.profile:
            results["profile_ms"] = {name: step_profile(model, prompt["input_ids"]) for name, model in models.items()}
    return results


def run_worker(command: list[str]) -> dict:
    """One measuring process's results; its error output is shown if it fails."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"a measuring process failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def threaded(args) -> str:
    """Which linear layers run on every thread (llama_moe_hf.lm_head): only ever float32 on CPU."""
    cpu_float32 = args.device == "cpu" and args.dtype == "float32"
    return args.threaded if cpu_float32 else "none"


def copy_bandwidth(device: str, synchronize, megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s moved (read + written): the median of `repeats` copies of a float32 buffer far larger than the caches."""
    import torch

    source = torch.randn(megabytes * 2**20 // 4, device=device)
    target = torch.zeros_like(source)  # written once, so no copy pays for first-touch page faults
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        target.copy_(source)
        synchronize()
        times.append(time.perf_counter() - start)
    return 2 * source.numel() * 4 / statistics.median(times) / 1e9


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
    tokens, its selector barely trained and not healed: the speed of a layout does not depend on how well its weights
    were chosen."""
    from llama_moe_hf import build_moe  # noqa: F811 (measure's is local to it)
    from llama_moe_hf.conversion.presets import preset_path
    from llama_moe_hf.conversion.recipe import load_recipe

    recipe, _ = load_recipe(preset_path(name))
    fast = dict(calibration_tokens=4096, calibration_samples=4096, heal_tokens=0)  # 16 sequences: enough to group
    if recipe.router_init == "selector":
        fast["selector_steps"] = 1
    return build_moe(dense, recipe, tokenizer=tokenizer, **fast)


def step_profile(model, input_ids, steps: int = 30) -> dict:
    """Milliseconds per decoding step by module kind, from forward hooks (which add a little time themselves)."""
    import collections

    from transformers import DynamicCache

    from llama_moe_hf.modeling.modeling_llama_moe import CACHE_ARG  # the dense model takes the same name

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


def main():
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
    parser.add_argument("--device", default="cpu", help="e.g. cuda (benchmarks/gpu_check.py's machine)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--experts-implementation", help="the MoE models' experts kernel (default: the model's own)")
    parser.add_argument(
        "--threaded",
        default="all",
        choices=["all", "lm-head", "none"],
        help="float32 on CPU: which linear layers run on every thread (all: use_threaded_linears compiled, the LM "
        "head eager)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile and args.compile and args.device != "cpu":
        parser.error("--profile with --compile splits a CPU step (kernels run asynchronously on a GPU)")
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
    print_bandwidth_table(runs, ["dense", *compared])
    if args.compile:
        equal = [run["compiled_equals_eager"] for run in runs]
        print("compiled greedy tokens equal the eager model's (static cache), per process:", equal)
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
    for run in runs if args.profile else []:
        for model, profile in run["profile_ms"].items():
            print(f"  {model} step: " + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in profile.items()))
        if args.compile:
            print_kernel_ratio(run["profile_ms"], compared)


def print_kernel_ratio(profile_ms: dict, compared: list[str]) -> None:
    """A compiled step's kernels (generated and aten) apart from the time around them, MoE against dense."""
    kernels = {name: ms["generated kernels"] + ms["aten calls"] for name, ms in profile_ms.items()}
    for name in compared:
        around = {model: profile_ms[model]["step"] - kernels[model] for model in ("dense", name)}
        ratio = kernels["dense"] / kernels[name]
        print(f"  kernels dense / {name}: {kernels['dense']:.2f} / {kernels[name]:.2f} ms = {ratio:.2f}x; "
              f"around them {around['dense']:.2f} / {around[name]:.2f} ms")  # fmt: skip


def print_bandwidth_table(runs: list[dict], names: list[str]) -> None:
    """Median decode tokens/s per model (all of `generate`, and its steps after the first new token), the ratios to
    dense, and the share of its bandwidth limit it reaches."""
    bandwidth = statistics.median(run["copy_gb_s"] for run in runs)
    print(f"copy bandwidth {bandwidth:.1f} GB/s (median of the processes)")
    print(
        "| model | weight MB read per token | limit tokens/s | decode tokens/s | vs dense | share of limit "
        "| after the first token, tokens/s | vs dense |"
    )
    print("|---|---|---|---|---|---|---|---|")
    dense, dense_steps = (statistics.median(run[task]["dense"] for run in runs) for task in ("decode", "decode_steps"))
    for name in names:
        rate, steps = (statistics.median(run[task][name] for run in runs) for task in ("decode", "decode_steps"))
        megabytes = runs[0]["step_bytes"][name] / 1e6
        limit = bandwidth * 1e3 / megabytes
        print(
            f"| {name} | {megabytes:.0f} | {limit:.1f} | {rate:.1f} | {rate / dense:.2f}x | {rate / limit:.0%} "
            f"| {steps:.1f} | {steps / dense_steps:.2f}x |"
        )


if __name__ == "__main__":
    main()

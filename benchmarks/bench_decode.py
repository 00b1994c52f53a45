"""Where users feel MoE speed: greedy decoding tokens/s and 512-token prefill, the default model against its MoE split.

The dense SmolLM2-135M-Instruct and the same model split into 8 experts with top-2 routing (`build_moe`, random
split, random router) run side by side in each process, interleaved round by round so that machine load falls on
both alike. Batch 1, float32, greedy, a chat prompt. Decoding: `generate` with a fixed number of new tokens.
Prefill: one forward of 512 tokens with a cache, keeping the last token's logits (what `generate` does first).
`--profile` also times one decoding step by module: attention, MLP (for the MoE model also its router and experts
inside it), norms, LM head, and the rest (embedding, rotary, masks, cache bookkeeping, Python between modules).

Timings on a shared VM can be bimodal across processes (docs/benchmarks.md): `--processes N` repeats the whole
measurement in N fresh processes and reports the median ratio and the spread.

    python benchmarks/bench_decode.py                          # 3 processes, 2 threads
    python benchmarks/bench_decode.py --processes 1 --profile
    python benchmarks/bench_decode.py --presets sparse-25 sparse-50 sparse-75 g-moefication   # presets' layouts
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

    from llama_moe_hf import build_moe
    from llama_moe_hf.checkpoints import default_model_path

    torch.set_num_threads(args.threads)
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if args.presets:
        models = {"dense": dense, **{name: preset_model(name, dense, tokenizer) for name in args.presets}}
    else:
        models = {"dense": dense, "moe": build_moe(dense, num_experts=args.num_experts, top_k=args.top_k)}
    messages = [{"role": "user", "content": "Write a long story about a dragon who learns to program computers."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    long_input = torch.randint(0, dense.config.vocab_size, (1, args.prefill_tokens), generator=torch.Generator())

    def decode(model):
        model.generate(**prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        return args.new_tokens

    def prefill(model):
        model(input_ids=long_input, logits_to_keep=1, use_cache=True)
        return args.prefill_tokens

    results = {}
    with torch.inference_mode():
        for name, task in (("decode", decode), ("prefill", prefill)):
            rates = {model: [] for model in models}
            for round_idx in range(args.warmup + args.rounds):
                for model_name, model in models.items():
                    start = time.perf_counter()
                    tokens = task(model)
                    if round_idx >= args.warmup:
                        rates[model_name].append(tokens / (time.perf_counter() - start))
            results[name] = {model: statistics.median(values) for model, values in rates.items()}
        if args.profile:
            results["profile_ms"] = {name: step_profile(model, prompt["input_ids"]) for name, model in models.items()}
    return results


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--presets", nargs="+", help="time these presets' layouts against dense instead of a split")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="also time one decoding step by module kind")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args)))
        return
    worker = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    runs = [json.loads(subprocess.run(worker, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            for _ in range(args.processes)]  # fmt: skip
    import torch

    compared = args.presets or ["moe"]
    against = ", ".join(args.presets) if args.presets else f"{args.num_experts} experts top-{args.top_k}"
    print(
        f"torch {torch.__version__}, threads={args.threads}, float32, batch 1 | SmolLM2-135M-Instruct dense vs "
        f"{against} | {args.processes} processes x {args.rounds} rounds"
    )
    for task, unit in (("decode", f"{args.new_tokens} new tokens"), ("prefill", f"{args.prefill_tokens} tokens")):
        for name in compared:
            ratios = [run[task][name] / run[task]["dense"] for run in runs]
            cells = ", ".join(f"{run[task]['dense']:.1f} / {run[task][name]:.1f}" for run in runs)
            print(f"{task} ({unit}), tokens/s dense / {name} per process: {cells}")
            print(f"  {name} / dense: median {statistics.median(ratios):.2f}x, "
                  f"range {min(ratios):.2f}-{max(ratios):.2f}x")  # fmt: skip
    for run in runs if args.profile else []:
        for model, profile in run["profile_ms"].items():
            print(f"  {model} step: " + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in profile.items()))


if __name__ == "__main__":
    main()

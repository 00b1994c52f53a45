"""SoapMoE speed against the dense model of the same shape, side by side in one process
(benchmarks/reports/soap-speed.md).

    python benchmarks/speed/bench_soap.py train    # training step (forward + backward), E = 8 and 32, S = 256
    python benchmarks/speed/bench_soap.py decode   # prompt-routing generation vs dense SmolLM2 (decode tokens/s)

train: LLaMA layers of SmolLM2's shape (hidden 576, FFN 1536, 9/3 heads, vocab 49152, tied), `--layers` of them,
  `--batch` rows of `--length` tokens; the dense LlamaForCausalLM against SoapMoE upcycled from it (every layer SOAP).
  The control is SoapMoE's own code with every MLP dense (the same head and loss as the SOAP models): the SOAP
  models' overhead over it is the SOAP blocks' alone. Also the MLP alone (a SOAP block against LlamaMLP), where the
  merge's share is largest. The models alternate within each round (in reverse order every other round); reported
  are the median time and the median over rounds of each round's ratio. Target: overhead under 1.5 x E/S + 5%.
  On CPU glibc's allocator returns every freed block above its mmap threshold to the system, so each step page-faults
  its large tensors in again: slow and noisy (benchmarks/reports/soap-speed.md). The header names the MALLOC_*
  settings in effect:

    MALLOC_MMAP_THRESHOLD_=17179869184 MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_TOP_PAD_=536870912 \
        python benchmarks/speed/bench_soap.py train
decode: SmolLM2-135M-Instruct (dense) against it upcycled into SoapMoE (8 experts, `routing_mode="prompt"`), greedy
  generation of `--new-tokens` after a 64-token prompt, batch 1. Target: within 5% of the dense tokens/s.
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import interleaved_times, medians
from llama_moe.source_families import dense_config_fields
from llama_moe_hf import SoapMoEConfig, SoapMoEForCausalLM, build_moe


def smollm2_shape(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )


def compare(steps: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each step in each of `repeats` rounds, after one warm-up call each. The steps alternate, in reverse
    order every other round, so the machine's slow phases and the order's own effects hit every step alike."""
    for step in steps.values():
        step()
    return interleaved_times(steps, repeats, alternate=True)


def overhead(samples: list[float], base: list[float]) -> float:
    """Median over rounds of the round's time against the base step's in the same round, in percent."""
    return 100 * (statistics.median(a / b for a, b in zip(samples, base)) - 1)


def training_step(model, input_ids):
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids, labels=input_ids).loss.backward()

    return step


def layer_step(module, hidden, **kwargs):
    def step():
        module.zero_grad(set_to_none=True)
        module(hidden, **kwargs).square().mean().backward()

    return step


def control_model(dense: LlamaForCausalLM, segment_length: int) -> SoapMoEForCausalLM:
    """SoapMoE's own code with every MLP dense: the same head, layers and loss as the SOAP models, no SOAP block."""
    fields = dense_config_fields(dense.config) | {"segment_length": segment_length, "moe_layers": []}
    return SoapMoEForCausalLM(SoapMoEConfig(**fields)).train()


def print_group(title: str, samples: dict[str, list[float]], segment_length: int, control: str | None) -> None:
    base = next(iter(samples))
    versus = f"   vs {control}" if control else ""
    print(f"{title}, threads {torch.get_num_threads()}\n  {'':24} {'median':>9}   vs {base}{versus}")
    for name, times in samples.items():
        experts = int(name.split("E=")[1]) if "E=" in name else 0
        cells = f"{overhead(times, samples[base]):+6.1f}%"
        if control:
            cells += f"   {overhead(times, samples[control]):+6.1f}%" if name not in (base, control) else ""
        target = f"   (target < {100 * (1.5 * experts / segment_length + 0.05):.1f}%)" if experts else ""
        print(f"  {name:24} {1000 * statistics.median(times):7.1f} ms  {cells}{target}")


def bench_train(args) -> None:
    torch.manual_seed(0)
    dense = LlamaForCausalLM(smollm2_shape(args.layers)).train()
    ids = torch.randint(0, 49152, (args.batch, args.length))
    hidden = torch.randn(args.batch, args.length, 576, requires_grad=True)
    mlp = LlamaMLP(dense.config)
    control = "soap code, dense MLPs"
    steps = {"dense": training_step(dense, ids), control: training_step(control_model(dense, args.segment_length), ids)}
    layers = {"dense MLP": layer_step(mlp, hidden)}
    for experts in args.experts:
        options = {"segment_length": args.segment_length}
        soap = build_moe(dense, family="soap_moe", num_experts=experts, options=options).train()
        steps[f"soap E={experts}"] = training_step(soap, ids)
        layers[f"SOAP block E={experts}"] = layer_step(soap.model.layers[0].mlp, hidden)
    shape = f"{args.batch} x {args.length} tokens, S = {args.segment_length}, {args.repeats} rounds"
    tuned = " ".join(f"{name}={value}" for name, value in sorted(os.environ.items()) if name.startswith("MALLOC_"))
    print(f"allocator: {tuned or 'glibc defaults'}")
    print_group(f"training step (model): {shape}", compare(steps, args.repeats), args.segment_length, control)
    print_group(f"forward + backward (MLP alone): {shape}", compare(layers, args.repeats), args.segment_length, None)


@torch.no_grad()
def bench_decode(args) -> None:
    from transformers import AutoModelForCausalLM

    from llama_moe.checkpoints import default_model_path

    dense = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    soap = build_moe(dense, family="soap_moe", num_experts=8, options={"routing_mode": "prompt"}).eval()
    prompt = torch.randint(100, 40000, (1, 64), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    models = {"dense": dense, "soap (prompt routing)": soap}
    samples = compare({name: (lambda m=m: m.generate(prompt, **kwargs)) for name, m in models.items()}, args.repeats)
    median = medians(samples)
    print(f"greedy generation, batch 1, 64-token prompt + {args.new_tokens} tokens, threads {torch.get_num_threads()}")
    base = median["dense"]
    for name, seconds in median.items():
        print(f"  {name:22} {args.new_tokens / seconds:8.1f} tokens/s  ({100 * (base / seconds - 1):+5.1f}% vs dense)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["train", "decode"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--segment-length", type=int, default=256)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    (bench_train if args.what == "train" else bench_decode)(args)


if __name__ == "__main__":
    main()

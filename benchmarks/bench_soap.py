"""SoapMoE speed against the dense model of the same shape, side by side in one process (docs/benchmarks.md).

    python benchmarks/bench_soap.py train    # training step (forward + backward), E = 8 and 32, S = 256
    python benchmarks/bench_soap.py decode   # prompt-routing generation vs dense SmolLM2 (decode tokens/s)

train: LLaMA layers of SmolLM2's shape (hidden 576, FFN 1536, 9/3 heads, vocab 49152, tied), `--layers` of them,
  `--batch` rows of `--length` tokens; the dense LlamaForCausalLM against SoapMoE upcycled from it (every layer SOAP).
  Also the MLP alone (a SOAP block against LlamaMLP), where the merge's share is largest. Timings alternate between
  the models; the median of `--repeats` is reported. Target: overhead under 1.5 x E/S + 5%.
decode: SmolLM2-135M-Instruct (dense) against it upcycled into SoapMoE (8 experts, `routing_mode="prompt"`), greedy
  generation of `--new-tokens` after a 64-token prompt, batch 1. Target: within 5% of the dense tokens/s.
"""

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

from llama_moe_hf import build_moe


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


def timed(step, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def compare(steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each step, measured in alternation after one warm-up call each."""
    for step in steps.values():
        step()
    samples = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            samples[name] += timed(step, 1)
    return {name: statistics.median(values) for name, values in samples.items()}


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


def bench_train(args) -> None:
    torch.manual_seed(0)
    dense = LlamaForCausalLM(smollm2_shape(args.layers)).train()
    ids = torch.randint(0, 49152, (args.batch, args.length))
    hidden = torch.randn(args.batch, args.length, 576, requires_grad=True)
    mlp = LlamaMLP(dense.config)
    steps, layers = {"dense": training_step(dense, ids)}, {"dense MLP": layer_step(mlp, hidden)}
    for experts in args.experts:
        options = {"segment_length": args.segment_length}
        soap = build_moe(dense, family="soap_moe", num_experts=experts, options=options).train()
        steps[f"soap E={experts}"] = training_step(soap, ids)
        layers[f"SOAP block E={experts}"] = layer_step(soap.model.layers[0].mlp, hidden)
    for title, group in (("training step (model)", steps), ("forward + backward (MLP alone)", layers)):
        medians = compare(group, args.repeats)
        base = next(iter(medians.values()))
        shape = f"{args.batch} x {args.length} tokens, S = {args.segment_length}"
        print(f"{title}: {shape}, threads {torch.get_num_threads()}")
        for name, seconds in medians.items():
            experts = int(name.split("E=")[1]) if "E=" in name else 0
            target = f", target < {100 * (1.5 * experts / args.segment_length + 0.05):.1f}%" if experts else ""
            print(f"  {name:22} {1000 * seconds:9.1f} ms  overhead {100 * (seconds / base - 1):+6.1f}%{target}")


@torch.no_grad()
def bench_decode(args) -> None:
    from transformers import AutoModelForCausalLM

    from llama_moe_hf.checkpoints import default_model_path

    dense = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    soap = build_moe(dense, family="soap_moe", num_experts=8, options={"routing_mode": "prompt"}).eval()
    prompt = torch.randint(100, 40000, (1, 64), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    models = {"dense": dense, "soap (prompt routing)": soap}
    medians = compare({name: (lambda m=m: m.generate(prompt, **kwargs)) for name, m in models.items()}, args.repeats)
    print(f"greedy generation, batch 1, 64-token prompt + {args.new_tokens} tokens, threads {torch.get_num_threads()}")
    base = medians["dense"]
    for name, seconds in medians.items():
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

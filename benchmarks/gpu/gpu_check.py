"""GPU checks of every model family: attention kernels, expert kernels, bf16, static cache, torch.compile, determinism.

Run it wherever a CUDA GPU is available (it needs no download: the models are random, or `--model` converts a local
dense checkpoint). Every family (LlamaMoE; AttnMoE, masked and gathered, with an MLP MoE) is built in memory and, in
bfloat16 on the GPU, compared with itself under the `eager` attention:

    attention   sdpa, flash_attention_2 (when the flash-attn package is installed), flex_attention
    experts     llama_moe_auto (grouped_mm on CUDA), grouped_mm, batched_mm, eager: logits against the eager loop
    generation  static-cache greedy tokens equal the dynamic cache's; a torch.compile'd (inductor, fullgraph)
                decoding step equals the eager step
    determinism with torch.use_deterministic_algorithms(True), two forwards of the default path are bitwise equal
    SoapMoE     upcycled equals the dense model; the merged fast path equals the reference; static-cache greedy tokens
                equal the dynamic cache's with segment and with prompt routing

    python benchmarks/gpu/gpu_check.py
    python benchmarks/gpu/gpu_check.py --model path/to/dense/llama --skip-compile
"""

import argparse
import copy
import importlib.util

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, StaticCache

from llama_moe_hf import build_moe

# family -> (routed recipe, the same with every expert selected). Kernel comparisons use the second: in bf16 an
# untrained router's near-ties flip expert choices between kernels, which would hide the kernels' own error.
# Generation and compile checks use the first.
ATTENTION = dict(family="attn_moe", attn_experts=4, mlp_moe=True, num_experts=8)
FAMILIES = {
    "llama_moe": (dict(num_experts=7, top_k=2, num_shared_experts=1),
                  dict(num_experts=7, top_k=7, num_shared_experts=1, router_init="zero")),
    "attn_moe masked": (dict(**ATTENTION, attn_top_k=2, top_k=2),
                        dict(**ATTENTION, attn_top_k=4, top_k=8, router_init="zero", attn_router_init="zero")),
}  # fmt: skip
FAMILIES["attn_moe gathered"] = FAMILIES["attn_moe masked"]


def dense_model(args):
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


class Report(list):
    """The checks' `(name, result, ok)` in order, each printed when made: a crash later leaves the earlier lines."""

    def append(self, check):
        name, result, ok = check
        print(f"{'ok ' if ok else 'BAD'}  {name}: {result}", flush=True)
        super().append(check)

    def guarded(self, name, check, *args):
        """Run `check(*args, self)`; an exception is one failed check, and the next family still runs."""
        try:
            check(*args, self)
        except Exception as error:  # noqa: BLE001 (reported, and the exit status says it failed)
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            self.append((f"{name}: raised", f"{type(error).__name__}: {first_line}", False))


def compare(name, got, expected, report, tolerance=0.02):
    """Relative error of the logits, ||got - expected|| / ||expected|| (bf16 rounding alone gives about 0.5%)."""
    got, expected = got.float(), expected.float()
    relative = ((got - expected).norm() / expected.norm()).item()
    agreement = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    report.append((name, f"relative error {relative:.2e}, top-1 agreement {agreement:.3f}", relative < tolerance))


def build(family, fields, dense, args):
    model = build_moe(dense, **fields).to(args.device, torch.bfloat16)
    if family.endswith("gathered"):
        model.config.attention_experts_implementation = "gathered"
    return model


@torch.no_grad()
def check_family(family, dense, input_ids, args, report):
    routed, every_expert = FAMILIES[family]
    model = build(family, every_expert, dense, args)
    model.set_attn_implementation("eager")
    reference = model(input_ids).logits
    attention = ["sdpa", "flex_attention"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])
    for implementation in attention:
        model.set_attn_implementation(implementation)
        compare(f"{family}: attention {implementation} vs eager", model(input_ids).logits, reference, report)
    model.set_attn_implementation("sdpa")
    sdpa = model(input_ids).logits
    for implementation in ("grouped_mm", "batched_mm", "eager", "llama_moe_auto"):
        model.set_experts_implementation(implementation)
        compare(f"{family}: experts {implementation} vs the default", model(input_ids).logits, sdpa, report)
    model = build(family, routed, dense, args)
    check_generation(family, model, input_ids[:1, :16], args, report)
    torch.use_deterministic_algorithms(True)
    try:
        same = torch.equal(model(input_ids).logits, model(input_ids).logits)
    finally:
        torch.use_deterministic_algorithms(False)
    report.append((f"{family}: deterministic default path", "bitwise equal" if same else "DIFFERENT", same))


def check_generation(family, model, prompt, args, report):
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    dynamic = model.generate(prompt, **kwargs)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    report.append((f"{family}: static cache greedy tokens", *same_greedy_tokens(dynamic, static, prompt.shape[1])))
    if args.skip_compile:
        return
    caches = [StaticCache(config=model.config, max_cache_len=64) for _ in range(2)]
    for cache in caches:
        model(prompt, cache=cache, use_cache=True)
    step = prompt[:, -1:]
    expected = model(step, cache=caches[0], use_cache=True).logits
    compiled = torch.compile(model.forward, fullgraph=True)
    actual = compiled(input_ids=step, cache=caches[1], use_cache=True).logits
    compare(f"{family}: compiled decoding step", actual, expected, report)


def same_greedy_tokens(reference, other, prompt_length: int) -> tuple[str, bool]:
    """Equal tokens, or equal up to a step where the reference's top two logits were within two bf16 rounding steps:
    random weights have such near-ties (the bf16 LlamaMoE check on a CPU parted at one, one step apart, and was equal
    in float32), where a wrong kernel parts at a clear choice."""
    first, second = reference.sequences[0, prompt_length:], other.sequences[0, prompt_length:]
    length = min(len(first), len(second))  # one may stop early at an end-of-text token
    parted = (first[:length] != second[:length]).nonzero()
    if not len(parted) and len(first) == len(second):
        return "equal", True
    step = parted[0].item() if len(parted) else length - 1
    top, runner_up = reference.scores[step][0].float().topk(2).values.tolist()
    near_tie = top - runner_up <= 2 * torch.finfo(torch.bfloat16).eps * max(abs(top), 1.0)
    verdict = "a near-tie" if near_tie else "DIFFERENT"
    return f"equal until step {step}, then {verdict} (top-2 logit margin {top - runner_up:.2g})", near_tie


@torch.no_grad()
def check_soap(dense, input_ids, args, report):
    """SoapMoE in bf16: upcycled equals the dense model; fast merged path equals the reference path; generation with
    the static cache equals the dynamic cache's, in both routing modes. (No compile check: its routing breaks the
    graph, so `generate` never compiles it; tests/modeling/test_soap_moe.py checks `torch.compile(model)` on CPU.)"""
    soap = build_moe(dense, family="soap_moe", num_experts=4, options={"segment_length": 64})
    soap = soap.to(args.device, torch.bfloat16)
    reference = copy.deepcopy(dense).to(args.device, torch.bfloat16)(input_ids).logits
    for implementation in ("sdpa", "eager"):
        soap.set_attn_implementation(implementation)
        compare(f"soap_moe: upcycled vs dense ({implementation})", soap(input_ids).logits, reference, report)
    for layer in soap.model.layers:
        layer.mlp.gate.weight.normal_(0, 1.0)  # routing that matters
    experts, x = soap.model.layers[0].mlp.experts, torch.randn(6, 64, dense.config.hidden_size, device=args.device)
    weights, index = torch.rand(6, 4, device=args.device).softmax(-1), torch.arange(4, device=args.device).expand(6, 4)
    x = x.to(torch.bfloat16)
    compare("soap_moe: merged fast path vs reference", experts(x, weights, index),
            experts.reference_forward(x, weights, index), report)  # fmt: skip
    for mode in ("segment", "prompt"):
        soap.config.routing_mode = mode
        for layer in soap.model.layers:
            layer.mlp.routing_mode = mode
        check_generation(f"soap_moe {mode} routing", soap, input_ids[:1, :80], argparse.Namespace(skip_compile=True),
                         report)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local dense LLaMA checkpoint (default: a random 4-layer model)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu runs the same checks (a smoke test of this script)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA GPU; none is visible here (--device cpu runs it on the CPU).")
    dense = dense_model(args)
    input_ids = torch.randint(0, dense.config.vocab_size, (2, args.tokens), device=args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{device} | torch {torch.__version__} | transformers {transformers.__version__}", flush=True)
    report = Report()
    for family in FAMILIES:
        report.guarded(family, check_family, family, dense, input_ids, args)
    report.guarded("soap_moe", check_soap, dense, input_ids, args)
    failed = [name for name, _, ok in report if not ok]
    print(f"{len(report) - len(failed)} of {len(report)} checks ok" + "".join(f"; BAD: {name}" for name in failed))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""CMoE's published code (github.com/JarvisPei/CMoE) on the built-in SmolLM2-135M-Instruct, on CPU in float32, with
the calibration tokens our conversions use: held-out perplexity as a ratio to the dense model (benchmarks/common.py)
and the carving time, at 25%, 50% and 75% of the FFN neurons active per token.

    git clone https://github.com/JarvisPei/CMoE /tmp/cmoe      # CMoE's code, not copied into this repository
    pip install lap                                             # CMoE's assignment solver (its only extra import)
    python benchmarks/quality/cmoe_reference.py --cmoe /tmp/cmoe       # S1A1E8, S2A2E8, S3A3E8
    python benchmarks/quality/cmoe_reference.py --configs S1A1E8 --layers 2 --calibration-tokens 1024 --max-tokens 1024

A configuration is CMoE's `S{shared}A{activated}E{experts}` (`--nshared --nactivated --nexperts` of its run_cmoe.py):
the FFN cut into E equal experts, S of them shared (always on), A of the E - S routed ones chosen per token, so
(S + A) / E of the neurons are active. The defaults keep CMoE's own ratio (its S2A2E16: as many shared as activated
routed experts) on 8 parts: S1A1E8 = 25%, S2A2E8 = 50%, S3A3E8 = 75%. K_a (`--k-act`) is CMoE's default, 10.

What runs is CMoE's `construct_moe` (CMoE_utils.py) on each decoder layer in turn, its input being the carved layers'
output on the calibration tokens, as CMoE's `cmoe_sequential` does; training-free (CMoE's LoRA fine-tuning, and the
load-balancing bias updates that come with it, are not run). Changed at run time and nothing else: CMoE_model.py and
CMoE_utils.py are executed with 'cuda' -> 'cpu' and torch.bfloat16 -> torch.float32, and each layer's attention is
called through `RotaryAttention` (transformers 5 takes the rotary embeddings, not position ids). The calibration
batch is all the calibration sequences (CMoE carves on its first batch of 8 x 2048 tokens). `--compare-splits` also
carves each layer's input (as CMoE saw it) with our `split_carve` and reports how far the two splits agree: optimal
balanced assignments are far from unique (docs/construction.md, "Carving"), so the routed experts differ by ties.
"""

import argparse
import contextlib
import re
import sys
import time
import types
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import heldout_tokens, perplexities, report
from llama_moe.conversion.calibration import tokenize_calibration
from llama_moe.conversion.methods.carve.carving import activation_markers, split_carve
from llama_moe.loading import load_model
from llama_moe.text.documents import load_texts

DEVICE_PATCHES = (("'cuda'", "'cpu'"), ("torch.bfloat16", "torch.float32"))
CONFIG = re.compile(r"S(\d+)A(\d+)E(\d+)")


def load_cmoe(checkout: Path) -> types.ModuleType:
    """CMoE_utils (and the CMoE_model it star-imports) executed from `checkout` with `DEVICE_PATCHES` applied."""
    for name in ("CMoE_model", "CMoE_utils"):
        path = checkout / f"{name}.py"
        source = path.read_text()
        for old, new in DEVICE_PATCHES:
            print(f"{path.name}: {source.count(old)} x {old} -> {new}")
            source = source.replace(old, new)
        module = types.ModuleType(name)
        module.__file__ = str(path)
        sys.modules[name] = module  # before executing CMoE_utils, whose `from CMoE_model import *` finds it here
        exec(compile(source, str(path), "exec"), module.__dict__)
    return sys.modules["CMoE_utils"]


class RotaryAttention(torch.nn.Module):
    """A layer's attention called as CMoE calls it, `(hidden_states, attention_mask, position_ids)`."""

    def __init__(self, attention, rotary):
        super().__init__()
        self.attention, self.rotary, self.layer_idx = attention, rotary, attention.layer_idx

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        cos_sin = self.rotary(hidden_states, position_ids)
        return self.attention(hidden_states, position_embeddings=cos_sin, attention_mask=attention_mask)


@contextlib.contextmanager
def recording(cmoe):
    """Within the context, CMoE's latest activation markers and split (expert groups, the shared neurons first, and
    representative neurons) are kept in the dict it yields."""
    latest, originals = {}, (cmoe.analyze_neuron_activations, cmoe.construct_experts_k_means)

    def analyze(*args, **kwargs):
        counts, rates, latest["markers"] = originals[0](*args, **kwargs)
        return counts, rates, latest["markers"]

    def construct(*args, **kwargs):
        groups, experts, representatives = originals[1](*args, **kwargs)
        latest["split"] = groups, representatives
        return groups, experts, representatives

    cmoe.analyze_neuron_activations, cmoe.construct_experts_k_means = analyze, construct
    try:
        yield latest
    finally:
        cmoe.analyze_neuron_activations, cmoe.construct_experts_k_means = originals


def carve_layer(cmoe, layer, hidden, config: tuple[int, int, int], options, rotary) -> tuple:
    """CMoE's `construct_moe` on one layer (its MLP becomes CMoE's MoE) -> (the layer's output, its MLP input)."""
    shared, activated, experts = config
    length = hidden.shape[1]
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]  # causal, as the model's own
    positions = torch.arange(length)[None]
    captured = []
    hook = layer.post_attention_layernorm.register_forward_hook(lambda module, args, output: captured.append(output))
    attention, layer.self_attn = layer.self_attn, RotaryAttention(layer.self_attn, rotary)
    try:
        hidden = cmoe.construct_moe(layer, hidden, mask, positions, experts, activated, shared, options)
    finally:
        layer.self_attn = attention
        hook.remove()
    return hidden, captured[0]


def compare_layer(cmoe_run: dict, mlp_input, dense_mlp, config: tuple[int, int, int], k_act: int) -> Counter:
    """Our carving of the layer input CMoE carved, next to CMoE's: identical markers (0/1), the same shared neurons
    but for ties in activation rate (0/1), and the fractions of routed neurons in the same expert (experts matched by
    overlap) and of representatives in common (the assignment and the seeds break ties differently)."""
    from scipy.optimize import linear_sum_assignment

    groups, representatives = cmoe_run["split"]
    shared, _, experts = config
    markers = activation_markers(mlp_input.flatten(0, 1), dense_mlp.gate_proj.weight, dense_mlp.up_proj.weight, k_act)
    ours = split_carve(markers, experts - shared, shared)
    rates = markers.float().mean(0)
    boundary = rates.sort(descending=True).values[max(len(groups[0]), 1) - 1]
    differ = set(groups[0]) ^ set(ours.shared_neurons.tolist()) if shared else set()
    overlap = torch.tensor([[len(set(g) & set(e.tolist())) for e in ours.expert_neurons] for g in groups[1:]])
    rows, columns = linear_sum_assignment(overlap.numpy(), maximize=True)
    return Counter(
        markers=int(torch.equal(markers, cmoe_run["markers"].bool())),
        shared=int(all(rates[n] == boundary for n in differ)),
        routed=overlap[rows, columns].sum().item() / overlap.sum().item(),
        representatives=len(set(representatives) & set(ours.representatives.tolist())) / len(representatives),
    )


def carve(cmoe, model, input_ids, config: tuple[int, int, int], args) -> tuple[float, Counter]:
    """CMoE's carving of the first `args.layers` layers of `model`, in place, layer after layer on the carved
    layers' output -> (carving seconds, with `args.compare_splits` the layers where ours agrees)."""
    options = types.SimpleNamespace(k_act=args.k_act, bias_speed=0.001)  # bias_speed: used in fine-tuning only
    seconds, agreement = 0.0, Counter()
    with torch.no_grad(), recording(cmoe) as cmoe_run:
        start = time.perf_counter()
        hidden = model.model.embed_tokens(input_ids)  # what CMoE's Catcher records as the first layer's input
        for layer in model.model.layers[: args.layers]:
            dense_mlp = layer.mlp
            hidden, mlp_input = carve_layer(cmoe, layer, hidden, config, options, model.model.rotary_emb)
            seconds += time.perf_counter() - start
            if args.compare_splits:
                agreement.update(compare_layer(cmoe_run, mlp_input, dense_mlp, config, args.k_act))
            start = time.perf_counter()
    return seconds, agreement


def agreement_text(agreement: Counter, layers: int) -> str:
    return (
        f"markers identical in {agreement['markers']}/{layers} layers, shared neurons identical up to rate ties in "
        f"{agreement['shared']}/{layers}, routed neurons in the same expert {agreement['routed'] / layers:.1%}, "
        f"representatives in common {agreement['representatives'] / layers:.1%}"
    )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cmoe", type=Path, default=Path("/tmp/cmoe"), help="a checkout of JarvisPei/CMoE")
    parser.add_argument("--configs", nargs="+", default=["S1A1E8", "S2A2E8", "S3A3E8"], help="CMoE's SxAyEz")
    parser.add_argument("--k-act", type=int, default=10, help="CMoE's K_a: neurons marked active per token")
    parser.add_argument("--calibration-tokens", type=int, default=32768, help="first tokens of the built-in corpus")
    parser.add_argument("--calibration-seq-len", type=int, default=256)
    parser.add_argument("--layers", type=int, default=None, help="carve only the first N layers (a quick check)")
    parser.add_argument("--max-tokens", type=int, default=16384, help="held-out tokens per text")
    parser.add_argument("--compare-splits", action="store_true", help="also carve with ours and compare")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not (args.cmoe / "CMoE_utils.py").is_file():
        parser.error(f"{args.cmoe} is not a CMoE checkout: git clone https://github.com/JarvisPei/CMoE {args.cmoe}")
    bad = [c for c in args.configs if not CONFIG.fullmatch(c)]
    if bad:
        parser.error(f"configurations look like S1A1E8, got {bad}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cmoe = load_cmoe(args.cmoe)
    dense, tokenizer, _ = load_model("default", dtype="float32", device="cpu")
    args.layers = args.layers or dense.config.num_hidden_layers
    texts, _ = load_texts(None)  # the converter's calibration data and tokenization
    input_ids = tokenize_calibration(texts, tokenizer, args.calibration_tokens, args.calibration_seq_len)
    tokens = heldout_tokens(tokenizer, args.max_tokens)
    print(f"torch {torch.__version__}, {args.threads} threads; calibration {list(input_ids.shape)}; K_a {args.k_act}")
    print(f"CMoE carves layers 0-{args.layers - 1} of {dense.config.num_hidden_layers}")
    reference = perplexities(dense, tokens)
    print(report("dense", reference, reference), flush=True)
    del dense
    for name in args.configs:
        config = tuple(int(n) for n in CONFIG.fullmatch(name).groups())
        model, _, _ = load_model("default", dtype="float32", device="cpu")
        seconds, agreement = carve(cmoe, model, input_ids, config, args)
        active = (config[0] + config[1]) / config[2]
        print(
            report(
                f"CMoE {name} ({active:.0%} active), carved in {seconds:.1f} s", perplexities(model, tokens), reference
            )
        )
        if args.compare_splits:
            print(f"  ours on the same layer inputs: {agreement_text(agreement, args.layers)}", flush=True)


if __name__ == "__main__":
    main()

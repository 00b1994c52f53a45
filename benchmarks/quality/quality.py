"""Training-free conversion quality on the real SmolLM2-135M-Instruct: perplexity of MoE conversions vs the dense model.

Calibration: the first 90% of the built-in stdlib-docstring corpus. Perplexity: 256-token chunks of the last 10%
(held out). Every MoE layer of every row has 8 experts (for splits with a shared expert: 1 shared + 7 routed, so "k/8
active" keeps k experts' worth of neurons per token). Routers:

    random    top-k of x . W for a seeded Gaussian W, selected experts weight 1
    kmeans    top-k of x . C for balanced k-means centroids C of the calibration MLP inputs, weight 1
    selector  G-MoEfication's trained selector (router_type="selector", weight 1), trained for the row's
              compensation setting
    oracle    per token, the experts with the largest deviation energy (`gmoefication.oracle_top_k`); no router does
              better, it is the reference the selector is measured against

All rows use unit weights for the selected experts (what G-MoEfication's compensation identity assumes); random and
k-means are applied with forward hooks on the router (evaluation only). Every model is built in memory by
`llama_moe_hf.build_moe`; all builds share one calibration context, so the calibration statistics (MLP input samples,
mean activations, k-means centroids, importance) are computed once for the whole table.

    python benchmarks/quality/quality.py                  # the full table of benchmarks/reports/gmoefication.md
    python benchmarks/quality/quality.py --splits cluster --active 6 7 --compensation on --routers selector oracle
"""

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import chunk_perplexity
from llama_moe.checkpoints import default_model_path
from llama_moe.conversion.calibration import CalibrationContext, tokenize_calibration
from llama_moe.conversion.plan import ConversionPlan
from llama_moe.conversion.routers.selector import gmoefication
from llama_moe.text.corpus import stdlib_docstrings
from llama_moe_hf import MoERecipe, build_moe

NUM_EXPERTS = 8
SEQ_LEN = 256
QUESTION = "What is the capital of France?"
SHARED = {"random": 0, "cluster": 0, "sharing-inter": 1, "residual": 1}  # shared experts of each split
ROUTERS = ("random", "kmeans", "selector", "oracle")
SELECTOR_HOLDOUT = 0.1  # `train_layer_selector`'s default: the last 10% of the calibration samples train no selector


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@torch.no_grad()
def chat_answer(model, tokenizer, max_new_tokens: int) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).strip()


@contextlib.contextmanager
def linear_routing(model, weights: dict[int, torch.Tensor]):
    """Route each MoE layer by top-k of x . W_layer with unit weights (forward hooks on the routers)."""

    def hook(router, args, output, weight):
        index = (args[0].float() @ weight.T).topk(router.top_k, dim=-1).indices
        return output[0], torch.ones(index.shape, dtype=output[1].dtype), index

    handles = [
        model.model.layers[i].mlp.gate.register_forward_hook(lambda r, a, o, w=w: hook(r, a, o, w))
        for i, w in weights.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def calibration_recipe(args) -> MoERecipe:
    """The calibration settings of every row: the shared context computes its statistics once, with these."""
    return MoERecipe(
        calibration_tokens=args.calibration_tokens, calibration_seq_len=SEQ_LEN, calibration_samples=args.hidden_samples
    )


def row_recipe(base: MoERecipe, args, method: str, compensation: bool) -> MoERecipe:
    """The conversion of one split and compensation setting: every layer, 8 experts, unit expert weights."""
    shared = SHARED[method]
    # The other routers replace the model's own through hooks: without the selector, a zero router is the cheapest.
    router_init = "selector" if "selector" in args.routers else "zero"
    fields = {
        "method": method,
        "num_experts": NUM_EXPERTS - shared,
        "num_shared_experts": shared,
        "top_k": max(args.active) - shared,  # what the selector's recall is measured at; each row sets its own
        "router_init": router_init,
        "score_scale_factor": 1.0,
        "compensation": compensation,
    }
    if method == "cluster":
        fields["cluster_on"] = args.cluster_on
    if router_init == "selector":
        fields["selector_steps"] = args.selector_steps
    return MoERecipe.from_dict({**base.to_dict(), **fields})


def expert_splits(dense, recipe: MoERecipe, context) -> dict:
    """layer -> the `ExpertSplit` that `build_moe(dense, recipe)` cuts: the oracle needs each expert's neurons, which
    the built model does not keep. The method's calibration comes from `context`, so nothing is recalibrated."""
    plan = ConversionPlan.create(recipe, dense.config)
    plan.prepare(context)
    method, _ = plan.components["mlp"]
    return {i: method.split(i, dense.model.layers[i].mlp.state_dict(), context) for i in plan.targets["mlp"].layers}


def expert_means(context, splits: dict, compensation: bool) -> dict[int, torch.Tensor]:
    """layer -> `[E, m]` mean activations of each expert's neurons; zeros without compensation (a dropped expert then
    loses its whole output)."""
    if not compensation:
        return {i: torch.zeros(split.expert_neurons.shape) for i, split in splits.items()}
    return {i: context.mlp(i).mean_activation[split.expert_neurons] for i, split in splits.items()}


@torch.no_grad()
def selector_recall(model, context, means: dict, top_k: int) -> dict[str, float]:
    """Energy recall at `top_k` of the built selectors, and of a random choice, on the calibration samples the
    selectors were not trained on (mean over layers; 1.0 = oracle)."""
    recalls = {"selector_recall": [], "random_recall": []}
    for i, mean in means.items():
        samples = context.mlp(i).hidden_states
        held_out = samples[max(1, round(samples.shape[0] * (1 - SELECTOR_HOLDOUT))) :]
        mlp = model.model.layers[i].mlp
        energy = gmoefication.deviation_energy(held_out, mlp.experts.gate_up_proj, mlp.experts.down_proj, mean)
        random_scores = torch.rand(energy.shape, generator=torch.Generator().manual_seed(0))
        recalls["selector_recall"].append(gmoefication.energy_recall(mlp.gate(held_out)[0], energy, top_k))
        recalls["random_recall"].append(gmoefication.energy_recall(random_scores, energy, top_k))
    return {key: sum(values) / len(values) for key, values in recalls.items()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", nargs="+", default=list(SHARED), choices=list(SHARED))
    parser.add_argument("--active", nargs="+", type=int, default=[2, 4, 6, 7])
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--compensation", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--cluster-on", default="gate", help="projection (or activations) the cluster split uses")
    parser.add_argument("--chunks", type=int, default=8, help="held-out 256-token chunks for perplexity")
    parser.add_argument("--calibration-tokens", type=int, default=16384)
    parser.add_argument("--hidden-samples", type=int, default=16384, help="MLP inputs per layer for selector/k-means")
    parser.add_argument("--selector-steps", type=int, default=100)
    parser.add_argument("--chat-active", nargs="*", type=int, default=[6, 7], help="active counts with a chat answer")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    return parser.parse_args()


def load_data(args):
    """The dense model, its tokenizer, and the calibration and held-out token chunks of the docstring corpus."""
    path = default_model_path()
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = stdlib_docstrings()
    cut = int(0.9 * len(texts))
    calibration_ids = tokenize_calibration(texts[:cut], tokenizer, args.calibration_tokens, SEQ_LEN)
    eval_ids = tokenize_calibration(texts[cut:], tokenizer, args.chunks * SEQ_LEN, SEQ_LEN)
    log(f"calibration {calibration_ids.numel()} tokens, held-out {eval_ids.numel()} tokens ({len(texts) - cut} docs)")
    return dense, tokenizer, calibration_ids, eval_ids


class Grid:
    """The rows of the table: every split x compensation x active count x router, from one calibration context."""

    def __init__(self, args, dense, tokenizer, context, base: MoERecipe, eval_ids):
        self.args, self.dense, self.tokenizer, self.context, self.base = args, dense, tokenizer, context, base
        self.eval_ids = eval_ids
        self.layers = list(range(dense.config.num_hidden_layers))
        self.rows, self.selector_quality = [], {}

    def split(self, method: str, compensations: list[bool]) -> None:
        args, shared = self.args, SHARED[method]
        routed = NUM_EXPERTS - shared
        log(f"--- split {method} ({routed} routed + {shared} shared)")
        recipes = {compensation: row_recipe(self.base, args, method, compensation) for compensation in compensations}
        # The same split for both compensation settings
        splits = expert_splits(self.dense, recipes[compensations[0]], self.context)
        random_weights = {
            i: torch.randn(routed, self.dense.config.hidden_size, generator=torch.Generator().manual_seed(i))
            for i in self.layers
        }
        linear_weights = {"random": random_weights}
        if "kmeans" in args.routers:
            linear_weights["kmeans"] = {i: self.context.kmeans_centroids(i, routed) for i in self.layers}
        for compensation, recipe in recipes.items():
            model = build_moe(self.dense, recipe, context=self.context)  # the selector trained for this setting
            means = expert_means(self.context, splits, compensation)
            if "selector" in args.routers:
                quality = selector_recall(model, self.context, means, recipe.top_k)
                self.selector_quality[(method, compensation)] = quality
                log(f"selector ({'with' if compensation else 'no'} compensation) {quality}")
            for active in args.active:
                self.score(model, method, active, compensation, means, linear_weights)

    def score(self, model, method: str, active: int, compensation: bool, means: dict, linear_weights: dict) -> None:
        """One row per router: `active` experts' worth of neurons per token."""
        args = self.args
        for layer in model.model.layers:
            layer.mlp.gate.top_k = active - SHARED[method]
        for router in args.routers:
            if router == "oracle":
                routing = gmoefication.oracle_routing(model, means)
            elif router == "selector":
                routing = contextlib.nullcontext()  # the model's own selector router
            else:
                routing = linear_routing(model, linear_weights[router])
            with routing:
                ppl = chunk_perplexity(model, self.eval_ids)
                chat = active in args.chat_active
                answer = chat_answer(model, self.tokenizer, args.max_new_tokens) if chat else ""
            self.rows.append((method, active, compensation, router, ppl, answer))
            log(f"{method} {active}/8 comp={compensation} {router}: ppl {ppl:.2f} {answer!r}")


def print_tables(grid: Grid, dense_ppl: float, dense_answer: str) -> None:
    rows, args = grid.rows, grid.args
    oracle = {(m, a, c): p for m, a, c, r, p, _ in rows if r == "oracle"}
    print(f"\nDense SmolLM2-135M-Instruct: perplexity {dense_ppl:.2f}; answer: {dense_answer!r}\n")
    print("| split | active | compensation | router | perplexity | x dense | x oracle | chat answer |")
    print("|---|---|---|---|---|---|---|---|")
    for method, active, compensation, router, ppl, answer in rows:
        ref = oracle.get((method, active, compensation))
        vs_oracle = f"{ppl / ref:.2f}" if ref else "-"
        print(
            f"| {method} | {active}/8 | {'on' if compensation else 'off'} | {router} | {ppl:.2f} | "
            f"{ppl / dense_ppl:.2f} | {vs_oracle} | {answer.replace('|', '/').replace(chr(10), ' ')} |"
        )
    if grid.selector_quality:
        print("\nSelector energy recall on held-out calibration tokens (mean over layers; 1.0 = oracle):\n")
        print("| split | selector target | top-k | selector | random choice |")
        print("|---|---|---|---|---|")
        for (method, compensation), quality in grid.selector_quality.items():
            print(
                f"| {method} | {'deviation from mean' if compensation else 'output'} | "
                f"{max(args.active) - SHARED[method]} | {quality['selector_recall']:.3f} | "
                f"{quality['random_recall']:.3f} |"
            )
    target = [
        (a, ppl / oracle[(m, a, c)])
        for m, a, c, r, ppl, _ in rows
        if m == "cluster" and c and r == "selector" and a in (6, 7) and (m, a, c) in oracle
    ]
    for active, ratio in target:
        verdict = "met" if ratio <= 1.15 else "NOT met"
        print(
            f"\nTarget cluster + selector + compensation at {active}/8 within 1.15x of the oracle: "
            f"{ratio:.3f}x ({verdict})"
        )


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    dense, tokenizer, calibration_ids, eval_ids = load_data(args)
    dense_ppl = chunk_perplexity(dense, eval_ids)
    dense_answer = chat_answer(dense, tokenizer, args.max_new_tokens)
    log(f"dense perplexity {dense_ppl:.2f}: {dense_answer!r}")
    base = calibration_recipe(args)
    context = CalibrationContext(base, lambda *_: dense, input_ids=calibration_ids, device=str(dense.device))
    # Every row reads the MLP statistics (compensation, selector, k-means, oracle): one pass records all layers.
    context.request_mlp(list(range(dense.config.num_hidden_layers)))
    grid = Grid(args, dense, tokenizer, context, base, eval_ids)
    for method in args.splits:
        grid.split(method, [setting == "on" for setting in args.compensation])
    context.release()
    print_tables(grid, dense_ppl, dense_answer)
    log(f"total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()

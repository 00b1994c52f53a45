"""`llama-moe eval`: perplexity, parameter counts, throughput and lm-eval tasks, of a converted or a dense model."""

import dataclasses

from ..evaluation.options import EvalOptions


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="perplexity (sliding window), total/active parameters, tokens/s, and lm-eval tasks",
        description="Measure a model: perplexity on local text or datasets sources with a sliding window, total and "
        "active parameters, tokens per second, and lm-evaluation-harness tasks (with the eval extra; the local task "
        "llama_moe_arithmetic runs offline). Works the same on a dense model, for comparison. The results go to "
        "eval_results.json, which `llama-moe push` puts into the model card's metadata.",
        dataclass_types=[EvalOptions],
    )
    parser.add_argument(
        "model", help="a local model folder, a Hub id ORG/NAME, or `default` (the built-in dense model)"
    )


def run(args) -> None:
    from ..evaluation.evaluate import evaluate

    options = EvalOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EvalOptions)})
    results, path = evaluate(args.model, options)
    parameters = results["parameters"]
    print(f"parameters: {parameters['total']:,} total, {parameters['active']:,} active per token")
    for name, result in results["perplexity"].items():
        speed = f", {result['tokens_per_second']:,.0f} tokens/s" if result["tokens_per_second"] else ""
        print(f"perplexity {name}: {result['perplexity']:.3f} ({result['tokens']:,} tokens{speed})")
    for task, metrics in results.get("lm_eval", {}).items():
        print(f"{task}: " + ", ".join(f"{metric} {value:.4f}" for metric, value in metrics.items()))
    print(f"wrote {path}")

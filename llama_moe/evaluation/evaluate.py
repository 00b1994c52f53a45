"""`eval`: perplexity on local text or `datasets` sources, parameter counts and throughput, and lm-eval tasks, for
our models and any dense causal LM alike (so a conversion can be compared with its source)."""

import json
from pathlib import Path

from .options import RESULTS_FILE, EvalOptions


def evaluate(model_spec: str, options: EvalOptions, *, download=None) -> tuple[dict, Path]:
    """Evaluate `model_spec` (folder, Hub id, or `default`); returns the results and the file they were written to."""
    from ..checkpoints.atomic import atomic_file
    from ..loading import load_model
    from ..preflight import check_writable, require

    if options.tasks:
        require("lm_eval", "--tasks")
    path = results_path(model_spec, options)
    check_writable(path, "--output" if options.output else "The results file")  # before the model is loaded
    sources = options.sources()
    model, tokenizer, _ = load_model(model_spec, dtype=options.dtype, device=options.device, download=download)
    results = {
        "model": str(model_spec),
        "dtype": str(model.dtype).removeprefix("torch."),
        **measure(model, tokenizer, sources, options),
    }
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(results, indent=2))
    return results, path


def results_path(model_spec: str, options: EvalOptions) -> Path:
    """--output, else eval_results.json in a local model folder (where `push` finds it), else in the current one."""
    from ..loading import DEFAULT_MODEL

    if options.output:
        return Path(options.output)
    local = Path(model_spec).expanduser().is_dir() and model_spec != DEFAULT_MODEL
    return (Path(model_spec).expanduser() if local else Path.cwd()) / RESULTS_FILE


def measure(model, tokenizer, sources: dict[str, str | None], options: EvalOptions) -> dict:
    """Parameter counts, perplexity per source (with tokens/s), and lm-eval scores of a loaded model."""
    from ..loading import parameter_counts

    total, active = parameter_counts(model)
    window = min(options.window, getattr(model.config, "max_position_embeddings", options.window))
    stride = options.stride or max(1, window // 2)
    results = {
        "parameters": {"total": total, "active": active},
        "perplexity": {
            name: _perplexity(model, tokenizer, name, spec, window, stride, options) for name, spec in sources.items()
        },
        "window": window,
        "stride": stride,
    }
    if options.tasks:
        from .harness import run_lm_eval

        results["lm_eval"], results["lm_eval_version"] = run_lm_eval(
            model,
            tokenizer,
            options.tasks,
            batch_size=options.batch_size,
            limit=options.limit,
            fewshot=options.num_fewshot,
        )
    return results


def _perplexity(model, tokenizer, name: str, spec, window: int, stride: int, options: EvalOptions) -> dict:
    from tqdm.auto import tqdm

    from ..perplexity import sliding_window_perplexity
    from ..text.documents import iter_documents
    from ..text.tokens import token_stream

    documents = iter_documents(spec, text_column=options.text_column, what=f"Evaluation data {name!r}")
    tokens = token_stream(documents, tokenizer, options.max_tokens)
    if tokens.numel() < 2:
        raise ValueError(f"Evaluation data {name!r} has fewer than 2 tokens.")
    with tqdm(total=tokens.numel() - 1, desc=f"perplexity {name}", unit="tok") as bar:
        result = sliding_window_perplexity(model, tokens, window, stride, options.batch_size, bar)
    # `dataset`: the `datasets` name read, or None for local text and the built-in corpus (`push` puts only
    # datasets into the card's model-index)
    dataset = spec if spec is not None and not Path(spec).expanduser().exists() else None
    return {"source": spec or "built-in corpus", "dataset": dataset, **result.as_dict()}

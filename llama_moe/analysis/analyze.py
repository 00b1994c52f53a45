"""`analyze`: stream each domain's text through a MoE model with hooks on its routers and write what they did.

analyze_model   model + tokenizer + domains -> the report (a dict of plain numbers)
analyze         a model reference + options -> the output folder (analysis.json, PNG plots, summary.md)
"""

import json
from pathlib import Path

import torch

from ..preflight import check_writable
from .options import AnalyzeOptions


def analyze(model_spec: str, options: AnalyzeOptions, *, download=None) -> dict:
    """Load `model_spec` (folder, Hub id, or `default`), analyse it on `options.data`, write `options.output`."""
    from ..checkpoints.atomic import atomic_folder
    from ..loading import load_model

    output = Path(options.output).expanduser()
    if output.exists() and not options.overwrite:
        raise ValueError(f"{output} exists; pass --overwrite to replace it.")
    check_writable(output, "--output")
    domains = options.domains()
    model, tokenizer, folder = load_model(model_spec, dtype=options.dtype, device=options.device, download=download)
    report = analyze_model(model, tokenizer, domains, options)
    report["model"] = str(model_spec)
    with atomic_folder(output) as tmp:
        write_report(report, tmp)
    return report


@torch.inference_mode()
def analyze_model(model, tokenizer, domains: dict[str, str | None], options: AnalyzeOptions) -> dict:
    """Route `options.max_tokens` tokens of every domain through `model`; the report of `report.site_report`s."""
    from .probes import find_sites
    from .report import kind_summary, site_report
    from .statistics import Recorder

    sites = find_sites(model)
    thresholds = {"soap": getattr(model.config, "utilization_threshold", None)}
    recorder = Recorder(sites, options.similarity_tokens, thresholds)
    tokens = {}
    with recorder.hooks():
        for name, spec in domains.items():
            recorder.domain = name
            tokens[name] = _run_domain(model, tokenizer, name, spec, options)
    reports = [
        site_report(probe, site, recorder.totals[site.name], recorder.products[site.name], thresholds.get(site.kind))
        for probe, site in sites
    ]
    kinds = dict.fromkeys(r["kind"] for r in reports)
    return {
        "family": model.config.model_type,
        "domains": {
            name: {"source": spec or "built-in corpus", "tokens": tokens[name]} for name, spec in domains.items()
        },
        "summary": {kind: kind_summary([r for r in reports if r["kind"] == kind]) for kind in kinds},
        "sites": reports,
    }


def _run_domain(model, tokenizer, name: str, spec: str | None, options: AnalyzeOptions) -> int:
    """Forward the domain's blocks in batches; returns the tokens read."""
    from tqdm.auto import tqdm

    from ..text.documents import iter_documents
    from ..text.tokens import token_blocks

    documents = iter_documents(spec, text_column=options.text_column, what=f"Domain {name!r}")
    blocks = token_blocks(documents, tokenizer, options.seq_len, options.max_tokens)
    read = 0
    with tqdm(total=options.max_tokens // options.seq_len * options.seq_len, desc=f"analyze {name}", unit="tok") as bar:
        while batch := [block for _, block in zip(range(options.batch_size), blocks)]:
            model(input_ids=torch.stack(batch).to(model.device), use_cache=False)
            read += len(batch) * options.seq_len
            bar.update(len(batch) * options.seq_len)
    if not read:
        raise ValueError(f"Domain {name!r} has fewer than --seq-len={options.seq_len} tokens.")
    return read


def write_report(report: dict, folder: Path) -> None:
    """analysis.json (every number), the plots, and summary.md into `folder`."""
    from .plots import write_plots
    from .summary import summary_markdown

    report["plots"] = write_plots(report["sites"], folder)
    (folder / "analysis.json").write_text(json.dumps(report, indent=1))
    (folder / "summary.md").write_text(summary_markdown(report))

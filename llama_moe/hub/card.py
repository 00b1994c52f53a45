"""What every model card this package writes shares: Hub tags, the Usage section (with and without the package),
links that work on the Hub, and, at push time, the card for the repository with what was measured since (evaluation
results, routing plots). Each writer renders its own card from these parts: a conversion's (settings, recipe,
parameters) is `conversion.conversion_card`, healing adds its section (`conversion.healing.folder`), trained
outputs' cards are `training.checkpoint`'s."""

from pathlib import Path

TAGS = ["moe", "mixture-of-experts", "llama-moe", "llama", "llama-moe-hf"]
PROJECT_URL = "https://github.com/llama-moe-hf/llama-moe-hf"
INSTALL_LINE = f"pip install 'llama-moe-hf @ git+{PROJECT_URL}'"  # not on PyPI: from the repository
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any one: the folder has a tokenizer
REFERENCES = (
    "- LLaMA-MoE: Building Mixture-of-Experts from LLaMA with Continual Pre-training (Zhu et al., 2024), "
    "arXiv:2406.16554.\n"
    "- Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints (Komatsuzaki et al., 2023), "
    "arXiv:2212.05055."
)
RESULTS_FILE = "eval_results.json"  # `llama-moe eval` writes it into a model folder; the card shows it at push time
LOCAL_TASK_PREFIX = "llama_moe_"  # lm-eval tasks of this package (evaluation/tasks/): local data, not Hub datasets


def public(value):
    """A local path as its last component (a card is public: it names no folder of the machine it was made on);
    anything else (a Hub id, a dataset name, a description) as it is."""
    if isinstance(value, str) and value and (Path(value).expanduser().is_absolute() or Path(value).exists()):
        return Path(value).name
    return value


def public_recipe(recipe: dict) -> dict:
    """The recipe as the card shows it: local paths (the model, the calibration data) by their names."""
    return {key: public(value) for key, value in recipe.items()}


def code_text() -> str:
    """Which llama-moe-hf code a folder carries and the transformers releases it runs on (the card's Usage section)."""
    from llama_moe_hf.modeling.configuration_llama_moe import (
        LLAMA_MOE_VERSION,
        TRANSFORMERS_REQUIREMENT,
        TRANSFORMERS_TESTED,
    )

    return (
        f"The modeling code stored next to the weights is llama-moe-hf {LLAMA_MOE_VERSION}'s: it runs on transformers "
        f"`{TRANSFORMERS_REQUIREMENT}` (tested with {' and '.join(TRANSFORMERS_TESTED)}). A copy with older code is "
        "brought up to date, weights untouched, with `llama-moe upgrade DIR`."
    )


def usage_section(model_id: str, *, tokenizer: bool = True, source: str | None = None) -> str:
    """The card's Usage section for the repository `model_id` (or a folder's name, before it is pushed). Without
    tokenizer files (`tokenizer=False`) it loads the tokenizer of the dense `source` (a Hub id, when known)."""
    if tokenizer:
        how = (
            "the tokenizer is a plain fast tokenizer and loads with no remote code and no prompt\n"
            "(`AutoTokenizer` reads the model's config first, which is remote code: without `trust_remote_code=True` "
            "it asks `[y/N]`,\nand in a script with no input it prints that prompt and a warning about a model of "
            "type `` and then loads this same tokenizer)"
        )
        tokenizer_class, tokenizer_id = "PreTrainedTokenizerFast", model_id
        command = f'llama-moe chat {model_id} --prompt "What is the capital of France?"'
        chat = f"It also gives the command line:\n`{command}`."
    else:  # a tokenizer loaded from here would fail: name the source's
        named = f" ([{source}](https://huggingface.co/{source}))" if source else ""
        how = (
            "this repository has **no tokenizer files**, so load the tokenizer of the dense model it was converted "
            f"from{named}"
        )
        tokenizer_class, tokenizer_id, chat = "AutoTokenizer", source or "path/to/the/source/model", ""
    return f"""## Usage

{code_text()}

With transformers alone: the modeling code stored next to the weights is used (`trust_remote_code=True`);
{how}:

```python
from transformers import AutoModelForCausalLM, {tokenizer_class}

model = AutoModelForCausalLM.from_pretrained("{model_id}", trust_remote_code=True)
tokenizer = {tokenizer_class}.from_pretrained("{tokenizer_id}")
messages = [{{"role": "user", "content": "What is the capital of France?"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=64, do_sample=False)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

With the llama-moe-hf package (`{INSTALL_LINE}`), `import llama_moe_hf` registers the model families with
the Auto classes, so no remote code runs and `trust_remote_code` is not needed. {chat}""".rstrip()


def absolute_doc_links(text: str) -> str:
    """`docs/NAME.md` mentions as links into the project's repository: a card is read on the Hub, where a path
    relative to this repository means nothing (mentions that are links already are left alone)."""
    import re

    return re.sub(
        r"(?<![\w/.\[-])(docs/[\w/-]+\.md)(#[\w-]+)?", lambda m: f"[{m[1]}]({PROJECT_URL}/blob/HEAD/{m[0]})", text
    )


def has_tokenizer(folder: Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


# ---------------------------------------------------------------------------------------------------------------
# At push time: the card for the repository pushed to, with what was measured since the conversion
# ---------------------------------------------------------------------------------------------------------------

ANALYSIS_FOLDER = "analysis"  # where `llama-moe analyze MODEL --output MODEL/analysis` puts its plots


def card_for_repo(text: str, folder: Path, repo_id: str) -> str:
    """The folder's card, made for `repo_id`: its Usage section names the repository; `eval_results.json` becomes
    the metadata's `model-index` (`EvalResult`s) and an Evaluation section; the routing plots of `analysis/` are
    shown in a Routing section. Sections it writes are replaced, not repeated, when the card already has them."""
    import json

    from huggingface_hub import ModelCard

    card = ModelCard(text)
    title, _, rest = card.text.lstrip("\n").partition("\n")
    body = f"# {repo_id.split('/')[-1]}\n{rest}" if title.startswith("# ") else card.text
    usage = usage_section(repo_id, tokenizer=has_tokenizer(folder), source=card.data.base_model)
    body = replace_section(body, "## Usage", usage)
    results_path = Path(folder) / RESULTS_FILE
    if results_path.is_file():
        results = json.loads(results_path.read_text(encoding="utf-8"))
        entries = eval_results(results)
        if entries:  # a model-index without results is no use on the Hub
            card.data.model_name, card.data.eval_results = repo_id.split("/")[-1], entries
        body = replace_section(body, "## Evaluation", evaluation_section(results))
    plots = sorted((Path(folder) / ANALYSIS_FOLDER).glob("routing_*.png"))
    if plots:
        body = replace_section(body, "## Routing", routing_section([p.relative_to(folder).as_posix() for p in plots]))
    card.text = body
    return str(card)


def eval_results(results: dict) -> list:
    """`EvalResult`s of an eval_results.json: perplexity per `datasets` source, and each lm-eval metric (not stderrs)
    of lm-eval's own tasks. The model-index names only what the Hub knows as a dataset: local text, the built-in
    corpus and this package's local tasks are in the Evaluation table only."""
    from huggingface_hub import EvalResult

    entries = []
    for name, value in results.get("perplexity", {}).items():
        dataset = hub_dataset(value)
        if dataset:
            dataset_type, _, config = dataset.partition(":")
            score = round(value["perplexity"], 4)
            entries.append(
                EvalResult("text-generation", dataset_type, name, "perplexity", score, dataset_config=config or None)
            )
    for task, metrics in results.get("lm_eval", {}).items():
        if task.startswith(LOCAL_TASK_PREFIX):  # a local task: its data is a file of this package
            continue
        entries += [
            EvalResult("text-generation", task, task, metric, round(value, 4), metric_name=f"{metric} (lm-eval)")
            for metric, value in metrics.items()
            if not metric.endswith("_stderr")
        ]
    return entries


def hub_dataset(measured: dict) -> str | None:
    """The `datasets` name (NAME or NAME:CONFIG) a perplexity was measured on, or None for local text and the
    built-in corpus. `llama-moe eval` records it (`dataset`); older results only say `source`, so a name that is no
    local path and no text file is taken for a dataset."""
    import re

    from ..text.documents import TEXT_SUFFIXES

    if "dataset" in measured:
        return measured["dataset"]
    spec = measured.get("source")
    if not spec or spec == "built-in corpus" or spec.startswith((".", "~", "/")) or Path(spec).exists():
        return None
    if Path(spec).suffix.lower() in TEXT_SUFFIXES or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?(:[\w.-]+)?", spec):
        return None
    return spec


def evaluation_section(results: dict) -> str:
    parameters = results.get("parameters", {})
    rows = [
        f"| perplexity ({name}) | {value['perplexity']:.3f} |" for name, value in results.get("perplexity", {}).items()
    ]
    for task, metrics in results.get("lm_eval", {}).items():
        rows += [f"| {task} {m} | {v:.4f} |" for m, v in metrics.items() if not m.endswith("_stderr")]
    window = f"sliding window {results.get('window')}, stride {results.get('stride')}"
    return (
        "## Evaluation\n\nMeasured with `llama-moe eval` "
        f"({results.get('dtype', '')}, {window}; {parameters.get('active', 0):,} of "
        f"{parameters.get('total', 0):,} parameters active per token):\n\n| | |\n|---|---|\n" + "\n".join(rows)
    )


def routing_section(plots: list[str]) -> str:
    images = "\n".join(f"![{Path(plot).stem}]({plot})" for plot in plots)
    return (
        "## Routing\n\nShare of each domain's tokens per expert and layer, from `llama-moe analyze` "
        f"(numbers in `{ANALYSIS_FOLDER}/analysis.json`, summary in `{ANALYSIS_FOLDER}/summary.md`):\n\n{images}"
    )


def replace_section(body: str, heading: str, section: str) -> str:
    """`body` with its `heading` section (up to the next `## `) replaced by `section`, or `section` added before
    the References (or at the end)."""
    start = body.find(f"\n{heading}\n")
    if start >= 0:
        end = body.find("\n## ", start + len(heading) + 2)
        return body[: start + 1] + section + "\n" + (body[end:] if end >= 0 else "")
    anchor = body.find("\n## References\n")
    if anchor < 0:
        return body.rstrip("\n") + "\n\n" + section + "\n"
    return body[: anchor + 1] + section + "\n\n" + body[anchor + 1 :]

"""lm-evaluation-harness around a model instance (`HFLM(pretrained=model)`), with this package's local tasks.

Task names are lm-eval's (e.g. `hellaswag`, which needs its dataset from the Hub) or a local task of `tasks/`
(`llama_moe_arithmetic`), whose data file ships with the package, so it runs offline.
"""

from pathlib import Path

TASK_FOLDER = Path(__file__).parent / "tasks"  # each task named `hub.card.LOCAL_TASK_PREFIX`...: the card skips them


def local_tasks() -> dict[str, dict]:
    """The task configs of `tasks/*.yaml`, their data files resolved to this folder."""
    import yaml

    tasks = {}
    for path in sorted(TASK_FOLDER.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        files = config["dataset_kwargs"]["data_files"]
        config["dataset_kwargs"]["data_files"] = {split: str(TASK_FOLDER / name) for split, name in files.items()}
        tasks[config["task"]] = config
    return tasks


def run_lm_eval(model, tokenizer, tasks: list[str], *, batch_size: int = 8, limit: int | None = None, fewshot=None):
    """{task: {metric: value}} (lm-eval's "acc,none" keys become "acc"; stderr kept as "acc_stderr"), and the
    lm-eval version."""
    from ..preflight import require

    require("lm_eval", "--tasks")
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    local = local_tasks()
    requested = [local.get(name, name) for name in tasks]
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, backend="causal")
    results = lm_eval.simple_evaluate(model=lm, tasks=requested, limit=limit, num_fewshot=fewshot, log_samples=False)
    scores = {}
    for task, metrics in results["results"].items():
        scores[task] = {
            key.split(",")[0]: value
            for key, value in metrics.items()
            if "," in key and isinstance(value, (int, float)) and value == value  # skip "N/A" and NaN stderr
        }
    return scores, lm_eval.__version__

"""Two-stage SFT demonstration (LLaMA-MoE v2): stage 1 on conversation, then stage 2 on math and code with 0%, 10% and
50% of stage 1's data replayed; for each, stage-2 task accuracy and stage-1 held-out loss (docs/training.md).

    llama-moe offline-data --output data/offline
    python benchmarks/quality/two_stage_sft.py --model outputs/smollm2-moe-cpt --output outputs/two-stage --use-cpu

Stage 1 runs `recipes/sft/stage1-general.yaml`; stage 2 runs `recipes/sft/stage2-math-code.yaml` with the replay
share set in its dataset fractions (math and code split the rest evenly). Evaluation, on the held-out splits:
    math accuracy   greedy answer to each held-out word problem; right when its "The answer is N" is right
    math loss       mean loss on the held-out worked answers, given the problem
    code loss       mean loss on the held-out functions' source (the assistant turn), given the request
    chat loss       mean loss on the held-out documentation answers (stage 1's data), given the question
Writes `results.json` and `two_stage.png` to --output.
"""

import argparse
import json
import re
from pathlib import Path

import torch

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "sft"


def sft_stage(config: str, model: str, output: Path, data: Path, overrides: list[str], fractions=None):
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser

    from llama_moe.training.sft import MoESFTArguments, run_sft

    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig, MoESFTArguments))
    argv = ["--config", config, "--model_name_or_path", model, "--output_dir", str(output), *overrides]
    script, training, model_args, mixture, moe = parser.parse_args_and_config(argv)
    for dataset in mixture.datasets:  # the recipe files name the default data folder
        dataset.data_files = dataset.data_files.replace("data/offline", str(data))
    for dataset, fraction in zip(mixture.datasets, fractions or []):
        dataset.fraction = fraction
    return run_sft(script, training, model_args, mixture, moe)


def read_chats(path: Path, limit: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:limit]]


@torch.no_grad()
def completion_loss(model, tokenizer, rows: list[dict]) -> float:
    """Mean loss per assistant token of each row's completion given its prompt (the chat template's rendering)."""
    total, count = 0.0, 0
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([tokenizer(full, add_special_tokens=False)["input_ids"][:1024]])
        labels = ids.clone()
        labels[:, : len(prompt_ids)] = -100
        n = int((labels[:, 1:] != -100).sum())
        total += model(input_ids=ids, labels=labels).loss.item() * n
        count += n
    return total / count


@torch.no_grad()
def math_accuracy(model, tokenizer, rows: list[dict]) -> float:
    right = 0
    for row in rows:
        inputs = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        output = model.generate(**inputs, max_new_tokens=64, do_sample=False)
        answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        expected = re.search(r"The answer is (\d+)\.", row["completion"][0]["content"]).group(1)
        found = re.search(r"The answer is (\d+)", answer)
        right += bool(found and found.group(1) == expected)
    return right / len(rows)


def evaluate(folder: Path, data: Path, limit: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llama_moe_hf  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    math = read_chats(data / "sft/math/test.jsonl", limit)
    return {
        "math_accuracy": math_accuracy(model, tokenizer, math),
        "math_loss": completion_loss(model, tokenizer, math),
        "code_loss": completion_loss(model, tokenizer, read_chats(data / "sft/code/test.jsonl", limit)),
        "chat_loss": completion_loss(model, tokenizer, read_chats(data / "sft/chat/test.jsonl", limit)),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.5))
    for axis, metric, title in zip(
        axes,
        ("math_accuracy", "math_loss", "code_loss", "chat_loss"),
        ("stage-2 math accuracy", "stage-2 math answer loss", "stage-2 code loss", "stage-1 chat held-out loss"),
    ):
        axis.bar(names, [results[name][metric] for name in names], color="#4c72b0")
        axis.set_title(title, fontsize=9)
        axis.tick_params(axis="x", labelsize=8, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the checkpoint stage 1 starts from")
    parser.add_argument("--output", required=True)
    parser.add_argument("--data", default="data/offline")
    parser.add_argument("--replay", type=float, nargs="+", default=[0.0, 0.1, 0.5])
    parser.add_argument("--stage1-epochs", default="1")
    parser.add_argument("--stage2-steps", default="40")
    parser.add_argument("--max-length", default="256")
    parser.add_argument("--eval-limit", type=int, default=40, help="held-out items per task")
    parser.add_argument("--use-cpu", action="store_true")
    args = parser.parse_args(argv)
    output, data = Path(args.output), Path(args.data)
    common = ["--max_length", args.max_length, "--gradient_accumulation_steps", "1"]
    # TRL checkpoints activations by default; on this CPU time is short, not memory.
    common += ["--use_cpu", "true", "--bf16", "false", "--gradient_checkpointing", "false"] if args.use_cpu else []
    results = {"start": evaluate(Path(args.model), data, args.eval_limit)}
    stage1 = [*common, "--num_train_epochs", args.stage1_epochs]
    sft_stage(str(RECIPES / "stage1-general.yaml"), args.model, output / "stage1", data, stage1)
    results["stage 1"] = evaluate(output / "stage1", data, args.eval_limit)
    for replay in args.replay:
        name = f"stage 2, replay {replay:.0%}"
        fractions = [(1 - replay) / 2, (1 - replay) / 2, replay]
        stage2 = [*common, "--max_steps", args.stage2_steps]
        folder = output / f"stage2-replay{replay:g}"
        sft_stage(str(RECIPES / "stage2-math-code.yaml"), str(output / "stage1"), folder, data, stage2, fractions)
        results[name] = evaluate(folder, data, args.eval_limit)
        print(name, results[name], flush=True)
    (output / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, output / "two_stage.png")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Fine-tune a converted MoE checkpoint with TRL's SFTTrainer (continued pre-training on text, or chat SFT).

Single process (CPU or one GPU):
    python recipes/sft.py --model outputs/smollm2-moe --output-dir outputs/smollm2-moe-sft

Several processes (GPUs; or two CPU processes over gloo with --use-cpu):
    torchrun --nproc_per_node 2 recipes/sft.py --model outputs/smollm2-moe --output-dir outputs/sft --use-cpu

Data: `--dataset` takes anything `datasets.load_dataset` reads (a Hub name, or "json"/"text"/"parquet" with
`--data-files`). A dataset with a "messages" column is trained as chat (the tokenizer's chat template); one with a
"text" column as plain language modelling. Without `--dataset`, the built-in corpus (Python standard-library
docstrings) is used, so the recipe runs offline.

The router load-balancing loss is added by SFTTrainer itself (`router_aux_loss_coef` from the model config).
"""

import argparse

from datasets import Dataset, load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import llama_moe_hf  # noqa: F401  (registers the LlamaMoE / AttnMoE classes)
from llama_moe_hf.conversion.corpus import stdlib_docstrings


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="converted checkpoint folder or Hub repo id")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--dataset", default=None, help="datasets name or builder (json/text/parquet); default: built-in")
    parser.add_argument("--data-files", default=None, help="local files for --dataset json/text/parquet")
    parser.add_argument("--split", default="train")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--router-aux-loss-coef", type=float, default=None, help="default: the model config's value")
    parser.add_argument("--use-cpu", action="store_true", help="train on CPU (multi-process over gloo)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_training_data(args: argparse.Namespace) -> Dataset:
    if args.dataset is None:
        return Dataset.from_dict({"text": stdlib_docstrings()})
    return load_dataset(args.dataset, data_files=args.data_files, split=args.split)


def main(argv=None) -> None:
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        max_length=args.max_length,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        router_aux_loss_coef=args.router_aux_loss_coef,
        logging_steps=max(1, args.max_steps // 10),
        save_strategy="no",
        use_cpu=args.use_cpu,
        ddp_backend="gloo" if args.use_cpu else None,
        bf16=args.bf16,
        seed=args.seed,
        report_to="none",
    )
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=load_training_data(args), processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()

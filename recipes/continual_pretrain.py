"""Continual pre-training of a converted MoE on a mixture of domains (LLaMA-MoE v1): static or dynamic sampling.

One process (CPU, or one GPU):
    python recipes/continual_pretrain.py --config recipes/pretrain/llama-moe-v1.yaml \
        --model_name_or_path outputs/smollm2-moe --output_dir outputs/smollm2-moe-cpt
Dynamic sampling against the dense model's per-domain losses:
    python recipes/continual_pretrain.py --config recipes/pretrain/llama-moe-v1.yaml --sampling dynamic \
        --reference_model path/to/dense --model_name_or_path outputs/smollm2-moe --output_dir outputs/cpt-dynamic
Several processes: `torchrun --nproc_per_node N recipes/continual_pretrain.py ...`, or
`accelerate launch --config_file recipes/accelerate/<ddp|zero2|zero3|fsdp2>.yaml recipes/continual_pretrain.py ...`.

Options: `ContinualPretrainArguments` (llama_moe_hf/training/pretrain.py) and transformers' `TrainingArguments`, from
flags or the YAML `--config` (TRL's `TrlParser`; flags override the file).
"""

from transformers import TrainingArguments
from trl import TrlParser

import llama_moe_hf  # noqa: F401  (registers the model families)
from llama_moe_hf.training.pretrain import ContinualPretrainArguments, continual_pretrain


def main(argv=None):
    args, training = TrlParser((ContinualPretrainArguments, TrainingArguments)).parse_args_and_config(argv)
    return continual_pretrain(args, training)


if __name__ == "__main__":
    main()

"""Continual pre-training of a converted MoE on a mixture of domains (LLaMA-MoE v1): static or dynamic sampling.

One process (CPU, or one GPU):
    python recipes/continual_pretrain.py --config recipes/pretrain/llama-moe-v1.yaml \
        --model_name_or_path outputs/smollm2-moe --output_dir outputs/smollm2-moe-cpt
Dynamic sampling against the dense model's per-domain losses:
    python recipes/continual_pretrain.py --config recipes/pretrain/llama-moe-v1.yaml --sampling dynamic \
        --reference_model path/to/dense --model_name_or_path outputs/smollm2-moe --output_dir outputs/cpt-dynamic
Distillation from the dense model the MoE was converted from (KL to its next-token distributions next to the LM loss):
    python recipes/continual_pretrain.py --config recipes/pretrain/distill.yaml \
        --model_name_or_path outputs/smollm2-moe --output_dir outputs/smollm2-moe-distill
Several processes: `torchrun --nproc_per_node N recipes/continual_pretrain.py ...`, or
`accelerate launch --config_file recipes/accelerate/<ddp|zero2|zero3|fsdp2>.yaml recipes/continual_pretrain.py ...`.

Options: `ContinualPretrainArguments` (llama_moe/training/pretrain.py) and transformers' `TrainingArguments`, from
flags or the YAML `--config` (`llama_moe.parsing.Parser`, TRL's `TrlParser`; flags override the file).
"""

from transformers import TrainingArguments

import llama_moe_hf  # noqa: F401  (registers the model families)
from llama_moe.parsing import Parser
from llama_moe.training.distill import check_training_and_teacher
from llama_moe.training.pretrain import ContinualPretrainArguments, continual_pretrain


def main(argv=None):
    parser = Parser((ContinualPretrainArguments, TrainingArguments), preflight=check_training_and_teacher)
    args, training = parser.parse_args_and_config(argv)
    return parser.run(continual_pretrain, args, training)


if __name__ == "__main__":
    main()

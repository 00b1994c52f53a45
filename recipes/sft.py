"""Supervised fine-tuning of a converted MoE with TRL's SFTTrainer: one YAML file per stage (LLaMA-MoE v2).

    python recipes/sft.py --config recipes/sft/stage1-general.yaml
    python recipes/sft.py --config recipes/sft/stage2-math-code.yaml     # starts from stage 1's output folder
The same files run under TRL's own command line (the checkpoints carry their modeling code):
    trl sft --config recipes/sft/stage1-general.yaml
Distilled from the dense model the MoE was converted from, with TRL's distillation trainers (`--distill gkd` or
`on_policy`; these files run under recipes/sft.py only):
    python recipes/sft.py --config recipes/sft/stage1-general-distill.yaml
    python recipes/sft.py --config recipes/sft/stage2-math-code-distill.yaml
Several processes: `torchrun --nproc_per_node N recipes/sft.py --config ...`, or
`accelerate launch --config_file recipes/accelerate/<ddp|zero2|zero3|fsdp2>.yaml recipes/sft.py --config ...`.

Options: TRL's `ScriptArguments`, `SFTConfig`, `ModelConfig`, `DatasetMixtureConfig` (exactly `trl sft`'s) plus
`MoESFTArguments` (`--freeze_routers`, `--distill` and the teacher's settings), from flags or the YAML `--config`
(`llama_moe.parsing.Parser`); flags override the file.
"""

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig

import llama_moe_hf  # noqa: F401  (registers the model families)
from llama_moe.parsing import Parser
from llama_moe.training.distill import check_training_and_teacher
from llama_moe.training.sft import MoESFTArguments, run_sft


def main(argv=None):
    arguments = (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig, MoESFTArguments)
    parser = Parser(arguments, preflight=check_training_and_teacher)
    return parser.run(run_sft, *parser.parse_args_and_config(argv))


if __name__ == "__main__":
    main()

"""Launched by test_training.py with `torchrun --nproc_per_node 2`: a few Trainer steps of a tiny LlamaMoE on CPU
with the gloo backend; every rank writes its final weights so the test can check they are identical."""

import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import Trainer, TrainingArguments

from llama_moe.parsing import finish_distributed_run
from llama_moe.source_families import dense_config_fields
from llama_moe_hf import LlamaMoEConfig, LlamaMoEForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
from helpers import tiny_llama_config


def main(output_dir: Path):
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    config = LlamaMoEConfig(
        **dense_config_fields(tiny_llama_config()), num_experts=4, num_experts_per_tok=2, output_router_logits=True
    )
    model = LlamaMoEForCausalLM(config)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, output_dir / "initial.safetensors")

    # Every rank builds the same data; the distributed sampler gives each rank its own half.
    tokens = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0)).tolist()
    dataset = Dataset.from_dict({"input_ids": tokens, "labels": tokens})
    args = TrainingArguments(
        output_dir=str(output_dir / "trainer"),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    assert trainer.args.world_size == 2
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, output_dir / f"rank{rank}.safetensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    finish_distributed_run()  # gloo's threads can abort a process at interpreter exit (SIGABRT, seen in CI)

"""Launched by test_scale_out.py: tiny MoE models trained a few steps on CPU, once as one process (`python`) and once
as two (`torchrun --nproc_per_node 2`, gloo). Every rank writes what it logged per step, so the test can check that
the runs computed the same thing.

    python scale_out_script.py OUT                            # per-device batch 4
    torchrun --nproc_per_node 2 scale_out_script.py OUT       # per-device batch 2: the same global batch of 4

The trainings of one launch:
- `trainer`: transformers `Trainer` on a LlamaMoE: one process, or DDP with two.
- `zero2`, `zero3` (two processes, when DeepSpeed is installed): `Trainer` with recipes/accelerate/ds_zero2.json and
  ds_zero3.json as they are ("auto" values filled by Trainer; fp32 here, as `bf16` is off), on LlamaMoE and, for
  ZeRO-3, on every family; DeepSpeed runs on CPU with gloo.
- `fsdp2`: a plain loop with the same optimizer, schedule and clipping as Trainer, for LlamaMoE, AttnMoE (the
  `gathered` attention, which reads `q_proj.weight` / `o_proj.weight` without calling those modules) and SoapMoE:
  one process, or FSDP2 (`fully_shard` on every decoder layer, then on the model) with two. Trainer cannot run FSDP
  on CPU: accelerate only switches to FSDP for GPU-like devices and trains with plain DDP instead (`MULTI_CPU`),
  silently, so this part does not go through Trainer.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import Trainer, TrainingArguments, default_data_collator

from llama_moe.parsing import finish_distributed_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
from helpers import SCALE_OUT_FAMILIES, TINY_VOCAB, scale_out_model

REPO = Path(__file__).parents[2]
GLOBAL_BATCH = 4
STEPS = 5
LENGTH = 16
LEARNING_RATE = 1e-2
MAX_GRAD_NORM = 1.0  # Trainer's default


# No load-balancing loss (output_router_logits=False): it is computed over each rank's own tokens and is not linear
# in the batch, so a 2 x 2 run differs from a 1 x 4 run by design, not by a bug. Dropout is 0 in these configs.
def token_rows() -> torch.Tensor:
    """Learnable sequences (each counts up from a random start by a random stride, modulo the vocabulary), so the
    loss falls and a wrong update would show. Equal lengths, no padding: every rank holds as many tokens as the
    others, so the mean of the per-rank mean losses is the global mean loss."""
    generator = torch.Generator().manual_seed(0)
    count = GLOBAL_BATCH * STEPS
    start = torch.randint(0, TINY_VOCAB, (count, 1), generator=generator)
    stride = torch.randint(1, 4, (count, 1), generator=generator)
    return (start + stride * torch.arange(LENGTH)) % TINY_VOCAB


# ---------------------------------------------------------------------------------------------------------------
# Trainer: one process, or DDP
# ---------------------------------------------------------------------------------------------------------------


class RecordingCollator:
    """`default_data_collator` that remembers the batches this rank was given, in order."""

    def __init__(self):
        self.batches = []

    def __call__(self, features):
        batch = default_data_collator(features)
        self.batches.append(batch["input_ids"].tolist())
        return batch


def train_with_trainer(output_dir: Path, world_size: int, family: str = "llama_moe", deepspeed: str | None = None):
    """Returns (what Trainer logged, the trainer)."""
    rows = token_rows().tolist()
    args = TrainingArguments(
        output_dir=str(output_dir / "trainer"),
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_BATCH // world_size,
        learning_rate=LEARNING_RATE,
        max_grad_norm=MAX_GRAD_NORM,
        optim="adamw_torch",  # the same (unfused) AdamW as the plain loop
        train_sampling_strategy="sequential",  # global batch i is rows [4i, 4i + 4) in every run
        logging_steps=1,
        use_cpu=True,
        ddp_backend="gloo" if world_size > 1 else None,
        deepspeed=str(REPO / "recipes" / "accelerate" / deepspeed) if deepspeed else None,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    collator = RecordingCollator()
    dataset = Dataset.from_dict({"input_ids": rows, "labels": rows})
    trainer = Trainer(model=scale_out_model(family), args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    record = {
        "world_size": args.world_size,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "losses": [entry["loss"] for entry in logs],
        "grad_norms": [entry["grad_norm"] for entry in logs],
        "batches": collator.batches[:STEPS],  # the loader may collate one batch ahead
    }
    return record, trainer


def train_with_deepspeed(output_dir: Path, world_size: int, family: str, stage: int) -> dict:
    record, trainer = train_with_trainer(output_dir, world_size, family, deepspeed=f"ds_zero{stage}.json")
    from deepspeed.utils import z3_leaf_module

    model = trainer.model_wrapped.module  # inside the DeepSpeed engine
    record["zero_stage"] = trainer.accelerator.state.deepspeed_plugin.zero_stage
    record["leaf_modules"] = sorted({type(m).__name__ for m in model.modules() if z3_leaf_module(m)})
    if stage == 3:  # ZeRO-3 empties a partitioned parameter and keeps its shard in `ds_tensor`; parameters under
        # `stage3_param_persistence_threshold` (norms and routers here) stay whole
        sizes = [(p.ds_numel, p.numel() == 0) for p in model.parameters()]
        record["partitioned_share"] = sum(n for n, empty in sizes if empty) / sum(n for n, _ in sizes)
    return record


# ---------------------------------------------------------------------------------------------------------------
# Plain loop: one process, or FSDP2
# ---------------------------------------------------------------------------------------------------------------


def shard(model) -> None:
    """FSDP2 as recipes/accelerate/fsdp2.yaml asks for it: each decoder layer a unit, the rest in the root unit."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def mean_over_ranks(value: torch.Tensor, world_size: int) -> float:
    value = value.detach().clone()
    if world_size > 1:
        dist.all_reduce(value)
    return value.item() / world_size


def train_plain_loop(family: str, rank: int, world_size: int) -> dict:
    """Trainer's update rule by hand: AdamW (no weight decay), linear decay from LEARNING_RATE, clipping at 1."""
    model = scale_out_model(family).train()
    if world_size > 1:
        shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (STEPS - step) / STEPS)
    rows, local = token_rows(), GLOBAL_BATCH // world_size
    losses, grad_norms = [], []
    for step in range(STEPS):
        first = step * GLOBAL_BATCH + rank * local  # the rows accelerate's sharded loader gives this rank
        batch = rows[first : first + local]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()  # FSDP2 reduce-scatters the mean of the ranks' gradients
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss, world_size))
        grad_norms.append(grad_norm.item())
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        # FSDP2 shards by turning parameters into DTensors: the proof that it really ran sharded.
        "parameter_class": type(next(model.parameters())).__name__,
    }


def main(output_dir: Path) -> None:
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    record = {"trainer": train_with_trainer(output_dir, world_size)[0]}  # Trainer sets up the gloo process group
    if world_size > 1 and importlib.util.find_spec("deepspeed"):
        record["zero2"] = {"llama_moe": train_with_deepspeed(output_dir, world_size, "llama_moe", 2)}
        record["zero3"] = {
            family: train_with_deepspeed(output_dir, world_size, family, 3) for family in SCALE_OUT_FAMILIES
        }
    record["fsdp2"] = {family: train_plain_loop(family, rank, world_size) for family in SCALE_OUT_FAMILIES}
    (output_dir / f"world{world_size}-rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    finish_distributed_run()  # gloo's threads can abort a process at interpreter exit (SIGABRT, seen in CI)

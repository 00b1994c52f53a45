"""SOAP pre-training of a small LLaMA (`recipes/pretrain_soap.py`): dense for the first `dense_fraction` of the steps,
upcycled into SoapMoE, trained on; or the dense baseline of the same steps and data (`variant: dense`).

Both stages use the same schedule settings; the second starts a fresh optimizer (as upcycling does: the expert tensors
are new parameters) and the dense baseline does the same, so the only difference between the variants is the
upcycling. Each stage keeps its checkpoints apart under `output_dir` (`dense-warmup/`, `upcycled/`); a finished
warm-up saves its weights and random state, so a run killed after it does not repeat it. Writes the final model as a
complete checkpoint and `results.json` (validation perplexity, tokens/s, expert utilisation).
"""

import dataclasses
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from safetensors.torch import load_file, load_model, save_file, save_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from llama_moe_hf.modeling import SoapMoEForCausalLM
from llama_moe_hf.modeling.modeling_soap_moe import expert_utilization

from ..checkpoints.atomic import atomic_file, atomic_folder
from ..conversion.build import build_moe
from ..footprint import FORCE_HELP, moe_config
from ..preflight import check_training
from ..similarity.options import BatchSimilarOptions
from ..similarity.pipeline import SimilarityOrder, load_tokenizer
from ..text.documents import load_texts
from ..text.tokens import document_tokens, pack
from .checkpoint import save_complete_checkpoint, stage_record
from .distributed import BalanceLossWeightMixin, DistributedTrainingMixin, start_deepspeed_comm
from .memory_check import check_recipe_memory
from .resume import (
    LATEST,
    NEVER,
    ResumableCheckpointsMixin,
    newest_complete_checkpoint,
    resume_checkpoint,
)

WARMUP, UPCYCLED = "dense-warmup", "upcycled"  # the stages' folders under output_dir


@dataclass
class SoapPretrainArguments:
    variant: str = field(
        default="soap",
        metadata={"help": "soap: upcycle after the warm-up; dense: stay dense", "choices": ["soap", "dense"]},
    )
    similarity_batching: bool = field(default=False, metadata={"help": "order documents by similarity before packing"})
    documents: str | None = field(default=None, metadata={"help": "documents (default: the built-in corpus)"})
    text_field: str | None = field(default=None, metadata={"help": "text field of JSON/parquet rows"})
    validation_documents: int = field(default=200, metadata={"help": "held-out documents for validation"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer (default: the built-in model's)"})
    seq_len: int = field(default=512, metadata={"help": "tokens per training sequence"})
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 688
    dense_fraction: float = field(default=0.05, metadata={"help": "share of the steps trained dense first"})
    num_experts: int = 8
    segment_length: int = 256
    merge_top_k: int | None = field(default=None, metadata={"help": "merge only the top-k experts (default: all)"})
    upcycle_noise: float = field(default=0.0, metadata={"help": "noise on the expert copies (fraction of std)"})
    validation_sequences: int = field(default=64, metadata={"help": "validation sequences evaluated at most"})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "start at step 0 and remove what an earlier run left in output_dir (default: resume)"},
    )
    force: bool = field(default=False, metadata={"help": FORCE_HELP})


def load_data(args: SoapPretrainArguments, tokenizer) -> tuple[Dataset, Dataset]:
    """Packed training and validation sequences from disjoint documents (a seeded split)."""
    texts, _ = load_texts(args.documents, text_column=args.text_field, what="Documents")
    order = np.random.default_rng(0).permutation(len(texts))
    validation = [texts[i] for i in order[: args.validation_documents]]
    train = [texts[i] for i in order[args.validation_documents :]]
    train_order = np.random.default_rng(1).permutation(len(train))
    if args.similarity_batching:  # `llama-moe batch-similar`'s defaults
        train_order = SimilarityOrder(BatchSimilarOptions(progress=False))(train)
    return _sequences(train, train_order, tokenizer, args.seq_len), _sequences(
        validation, np.arange(len(validation)), tokenizer, args.seq_len, limit=args.validation_sequences
    )


def _sequences(texts, order, tokenizer, seq_len: int, limit: int | None = None) -> Dataset:
    packed = pack(list(document_tokens(texts, tokenizer)), order, seq_len)
    rows = [row["input_ids"] for row in packed.rows() if len(row["input_ids"]) == seq_len][:limit]
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def dense_model(args: SoapPretrainArguments, tokenizer, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(dense_config(args, tokenizer))


def dense_config(args, tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


class RoutingTrainer(DistributedTrainingMixin, BalanceLossWeightMixin, ResumableCheckpointsMixin, Trainer):
    """Adds the SOAP layers' expert utilisation on a fixed validation batch to every training log line."""

    routing_batch: torch.Tensor | None = None
    resumed_from: str | None = None  # the checkpoint this stage continued from

    def log(self, logs: dict, *args, **kwargs) -> None:
        if isinstance(self.model, SoapMoEForCausalLM) and self.routing_batch is not None and "loss" in logs:
            logs["expert_utilization"] = round(routing_statistics(self.model, self.routing_batch)["utilization"], 4)
        super().log(logs, *args, **kwargs)


@torch.no_grad()
def routing_statistics(model: SoapMoEForCausalLM, input_ids: torch.Tensor) -> dict:
    """Expert utilisation (share of experts at or above the threshold), mean largest routing weight, and each
    layer's utilisation, on `input_ids`."""
    was_training = model.training
    model.eval()
    weights = model(input_ids.to(model.device), output_routing_weights=True).routing_weights
    model.train(was_training)
    per_layer = expert_utilization(weights, model.config.utilization_threshold)
    return {
        "utilization": per_layer.mean().item(),
        "utilization_per_layer": [round(u, 4) for u in per_layer.tolist()],
        "mean_max_weight": torch.stack([w.max(-1).values.mean() for w in weights]).mean().item(),
    }


def train_stage(model, training: TrainingArguments, train: Dataset, steps: int, seed: int, routing_batch, stage: str):
    """`steps` optimiser steps of `model` on `train` (data order from `seed`), resumed from the stage's newest complete
    checkpoint under `output_dir/stage` when there is one; returns (trainer, seconds)."""
    folder = str(Path(training.output_dir) / stage)
    stage_args = dataclasses.replace(training, max_steps=steps, seed=seed, output_dir=folder)
    checkpoint = resume_checkpoint(stage_args) if training.save_strategy != "no" else None
    trainer = RoutingTrainer(model=model, args=stage_args, train_dataset=train)
    trainer.routing_batch, trainer.resumed_from = routing_batch, checkpoint
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer, time.perf_counter() - start


def warm_up(model, args, training: TrainingArguments, train: Dataset, steps: int, routing_batch) -> float:
    """The dense warm-up, or what a finished one of the same settings saved (its weights and the random state
    upcycling starts from); returns its seconds. Saved when checkpoints are asked for, so a run killed after it does
    not repeat it."""
    done = Path(training.output_dir) / WARMUP / "final"
    settings = {"arguments": asdict(args), "seed": training.seed, "max_steps": training.max_steps, "steps": steps}
    settings = json.loads(json.dumps(settings))  # as the file holds them
    if (done / "model.safetensors").is_file():
        saved = json.loads((done / "warmup.json").read_text())
        if saved["settings"] != settings:
            raise ValueError(
                f"{done} was written by a run with other settings: pass --overwrite_output_dir true to start over."
            )
        load_model(model, done / "model.safetensors")
        torch.set_rng_state(load_file(done / "random_state.safetensors")["torch"])
        return saved["seconds"]
    trainer, seconds = train_stage(model, training, train, steps, training.seed, routing_batch, WARMUP)
    if training.save_strategy != "no" and trainer.is_world_process_zero():
        with atomic_folder(done) as tmp:
            save_model(model, tmp / "model.safetensors")  # the tied embeddings once
            save_file({"torch": torch.get_rng_state()}, tmp / "random_state.safetensors")
            (tmp / "warmup.json").write_text(json.dumps({"settings": settings, "seconds": seconds}))
    return seconds


def largest_config(args: SoapPretrainArguments, tokenizer):
    """The config of the model the run holds the most memory for: the upcycled one (SOAP), else the dense one."""
    config = dense_config(args, tokenizer)
    if args.variant != "soap":
        return config
    options = {"segment_length": args.segment_length, "merge_top_k": args.merge_top_k}
    return moe_config(config, family="soap_moe", num_experts=args.num_experts, **options)


def upcycle(model: LlamaForCausalLM, args: SoapPretrainArguments) -> SoapMoEForCausalLM:
    options = {"segment_length": args.segment_length, "merge_top_k": args.merge_top_k}
    if args.upcycle_noise:
        options["upcycle_noise"] = args.upcycle_noise
    return build_moe(model, family="soap_moe", num_experts=args.num_experts, options=options).train()


def pretrain(args: SoapPretrainArguments, training: TrainingArguments) -> None:
    """Warm up dense, upcycle, train; write the complete checkpoint and results.json (module docstring)."""
    asked = training.resume_from_checkpoint
    start_over = args.overwrite_output_dir or (asked is not None and str(asked).lower() in NEVER)
    tokenizer = load_tokenizer(args.tokenizer)
    check_recipe_memory(largest_config(args, tokenizer), args.seq_len, None, training, args)
    train, validation = load_data(args, tokenizer)
    with training.main_process_first(desc="removing the stages of an earlier run"):  # once the data were read
        if start_over and training.process_index == 0:
            for stage in (WARMUP, UPCYCLED):
                shutil.rmtree(Path(training.output_dir) / stage, ignore_errors=True)
    training = dataclasses.replace(training, resume_from_checkpoint=None)  # each stage: its newest checkpoint
    routing_batch = torch.tensor(validation[:4]["input_ids"])
    start_deepspeed_comm(training)
    model = dense_model(args, tokenizer, training.seed)
    warm_steps = max(1, round(args.dense_fraction * training.max_steps))
    warm_seconds = warm_up(model, args, training, train, warm_steps, routing_batch)
    if args.variant == "soap":
        model = upcycle(model, args)
    steps = training.max_steps - warm_steps
    trainer, seconds = train_stage(model, training, train, steps, training.seed + 1, routing_batch, UPCYCLED)
    results = evaluate(trainer, model, args, validation, routing_batch)
    tokens = training.max_steps * training.per_device_train_batch_size * training.world_size * args.seq_len
    tokens *= training.gradient_accumulation_steps
    results.update(
        train_tokens=tokens,
        train_seconds=round(warm_seconds + seconds, 1),
        # a resumed run timed only the steps after its checkpoint
        tokens_per_second=None if trainer.resumed_from else round(tokens / (warm_seconds + seconds), 1),
        resumed_from=trainer.resumed_from and Path(trainer.resumed_from).name,
        parameters=sum(p.numel() for p in model.parameters()),
        arguments=asdict(args),
    )
    data = {Path(args.documents).name if args.documents else "built-in corpus (stdlib docstrings)": 1.0}
    scores = {k: results[k] for k in ("validation_loss", "validation_perplexity")}
    record = stage_record(trainer, f"soap-pretraining ({args.variant})", data, "scratch", tokens=tokens, results=scores)
    save_complete_checkpoint(trainer, tokenizer, training.output_dir, "a LLaMA initialised from scratch", record)
    if trainer.is_world_process_zero():
        with atomic_file(Path(training.output_dir) / "results.json") as path:
            path.write_text(json.dumps(results, indent=2))
        print(json.dumps({k: v for k, v in results.items() if k != "arguments"}))


def preflight(values) -> None:
    check_training(values)
    asked = None if values.resume_from_checkpoint is None else str(values.resume_from_checkpoint).lower()
    if asked is not None and asked not in LATEST + NEVER:
        raise ValueError("resume_from_checkpoint: this recipe resumes both stages from output_dir; give true or false.")
    if asked in LATEST and values.overwrite_output_dir:
        raise ValueError("--overwrite_output_dir true starts over: it cannot go with --resume_from_checkpoint.")
    stages = [Path(values.output_dir) / stage for stage in (WARMUP, UPCYCLED)]
    found = (stages[0] / "final").is_dir() or any(newest_complete_checkpoint(s, clean=False) for s in stages)
    if asked in LATEST and not found:
        raise ValueError(f"resume_from_checkpoint {asked}: {values.output_dir} holds no checkpoint of either stage.")


def evaluate(trainer, model, args, validation: Dataset, routing_batch) -> dict:
    loss = trainer.evaluate(validation)["eval_loss"]
    results = {"variant": args.variant, "similarity_batching": args.similarity_batching}
    results.update(validation_loss=round(loss, 4), validation_perplexity=round(math.exp(loss), 2))
    if isinstance(model, SoapMoEForCausalLM):
        results["routing"] = routing_statistics(model, routing_batch)
    return results

"""Joint healing: after the layer-wise pass (`layer.LayerHealer`), every layer of the converted model trained at once to
reproduce the dense model's next-token distributions on the calibration tokens (`--joint-heal-tokens`).

The layer-wise heal fits each MoE MLP to the dense hidden states alone, so errors that add up across layers stay; this
stage pays for them once. It is `recipes/pretrain/joint-heal.yaml` run inside the conversion, with that recipe's
settings: the KL to the dense model (temperature 1) at `--joint-heal-kl-weight` (the calibration text's LM loss has the
rest: 0.5 by default, 1 in the presets), the routers' balance loss at 0.01, batches of 4
sequences, AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices), a tenth of the steps of warm-up, then cosine to a
tenth of the learning rate, gradients clipped at 1 (measurements: benchmarks/reports/calibration-and-levers.md,
"Calibration corpus and the levers").
The last batch is held back: its KL to the dense model before and after training is what the stage reports, and a
stage that ends further from the dense model than it began says so as a warning.

    heal_jointly(student, teacher, input_ids, lr)    trains a model in memory (`build_moe`: heal_built_model)
    heal_folder_jointly(folder, teacher, ...)        the same for a written folder (`llama-moe convert`)
    write_joint_text(path, input_ids, tokenizer)     where it does not fit in one process: its tokens as text,
    recipe_command(folder, text, recipe)             and the command that runs it as the training recipe
"""

import json
import logging
import math
import shlex
import time

import torch

from ...distillation import distillation_kl, distillation_objective

logger = logging.getLogger(__name__)

BATCH_SEQUENCES = 4
KL_WEIGHT = 0.5  # the default `joint_heal_kl_weight`: the LM loss has the rest
ROUTER_AUX_LOSS_COEF = 0.01
WARMUP_SHARE = 0.1
MIN_LR_RATE = 0.1
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
MAX_GRAD_NORM = 1.0


def heal_jointly(
    student, teacher, input_ids: torch.Tensor, lr: float, progress: bool = True, kl_weight: float = KL_WEIGHT
) -> dict:
    """Train `student` (an MoE causal LM, in place; left in eval mode) towards `teacher` (its dense model) on
    `input_ids` (`[B, S]` calibration sequences, one pass; the last batch held back when there are two or more).
    Returns what `conversion_info["joint_healing"]` records: tokens, steps, learning rate, KL weight, the KL to the
    dense model on the held-back batch before and after, over the first and the last tenth of the steps, seconds."""
    from tqdm.auto import tqdm
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    batches = input_ids.split(BATCH_SEQUENCES)
    held = batches[-1] if len(batches) > 1 else None
    batches = batches[:-1] if held is not None else batches
    device = next(student.parameters()).device
    optimizer = torch.optim.AdamW(parameter_groups(student), lr=lr, betas=BETAS)
    warmup = max(1, round(WARMUP_SHARE * len(batches)))
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, len(batches), min_lr_rate=MIN_LR_RATE)
    teacher.eval()
    before = held_out_kl(student, teacher, held, device)
    student.train()
    kls, start = [], time.perf_counter()
    try:
        for batch in tqdm(batches, desc="Healing all layers jointly", unit="step", disable=not progress):
            loss, kl = distillation_loss(student, teacher, batch.to(device), kl_weight)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            kls.append(kl)
    finally:
        student.eval()
    info = _info(input_ids, len(batches), lr, kl_weight, kls, before, held_out_kl(student, teacher, held, device))
    info["seconds"] = round(time.perf_counter() - start, 1)
    _report(info)
    return info


def _info(input_ids, steps, lr, kl_weight, kls, before, after) -> dict:
    tenth = max(1, len(kls) // 10)
    info = {"tokens": input_ids.numel(), "steps": steps, "lr": lr, "kl_weight": kl_weight}
    if before is not None:
        info |= {"held_out_kl_before": round(before, 4) + 0.0, "held_out_kl_after": round(after, 4) + 0.0}
    return (
        info
        | {
            "kl_first_steps": round(sum(kls[:tenth]) / tenth, 4) + 0.0,  # + 0.0: never -0.0
            "kl_last_steps": round(sum(kls[-tenth:]) / tenth, 4) + 0.0,
        }
    )


def _report(info: dict) -> None:
    if "held_out_kl_before" not in info:
        logger.info("Joint healing: KL to the dense model %(kl_first_steps)s -> %(kl_last_steps)s.", info)
        return
    logger.info(
        "Joint healing: KL to the dense model on a held-back batch %(held_out_kl_before)s -> %(held_out_kl_after)s.",
        info,
    )
    if info["held_out_kl_after"] > info["held_out_kl_before"]:
        logger.warning(
            "Joint healing ended further from the dense model than it began (KL %(held_out_kl_before)s -> "
            "%(held_out_kl_after)s on held-back text): raise --joint-heal-kl-weight or lower --joint-heal-lr.",
            info,
        )


@torch.no_grad()
def held_out_kl(student, teacher, batch, device) -> float | None:
    """Mean KL(teacher || student) per position on `batch` (None without one)."""
    if batch is None:
        return None
    batch = batch.to(device)
    return (
        distillation_kl(student(input_ids=batch).logits[:, :-1], teacher(input_ids=batch).logits[:, :-1]).mean().item()
    )


def heal_built_model(model, dense_model, context, recipe, progress: bool = False) -> None:
    """`build_moe`'s joint stage, where `recipe` asks for one (`joint_heal_tokens`): `heal_jointly` on the calibration
    context's tokens (`joint_heal_tokens`), recorded in the model's `conversion_info`."""
    if not recipe.joint_heal_tokens:
        return
    tokens = joint_heal_tokens(context, recipe)
    info = heal_jointly(model, dense_model, tokens, recipe.joint_heal_lr, progress, recipe.joint_heal_kl_weight)
    model.config.conversion_info = {**model.config.conversion_info, "joint_healing": info}


def joint_heal_tokens(context, recipe) -> torch.Tensor:
    """The joint stage's `[B, S]` calibration tokens: those after the tokens the layer-wise heal fitted, on which the
    MoE already matches the dense model layer by layer and which teach this stage less
    (benchmarks/reports/calibration-and-levers.md); the first ones where the text has no more."""
    seq_len = recipe.calibration_seq_len
    tokens = context.tokens(recipe.heal_tokens + recipe.joint_heal_tokens)
    fresh = tokens[recipe.heal_tokens // seq_len :]
    return fresh if len(fresh) else tokens[: max(1, recipe.joint_heal_tokens // seq_len)]


def parameter_groups(model) -> list[dict]:
    """Weight decay on matrices only (not on norms and biases), as transformers' Trainer decays."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
    ]


def distillation_loss(student, teacher, input_ids: torch.Tensor, kl_weight: float = KL_WEIGHT):
    """(loss, mean KL per position): `distillation_objective` at alpha `kl_weight` and temperature 1, the weighting
    `training.distill.Distiller` trains with."""
    coef = getattr(student.config, "router_aux_loss_coef", 0.0)
    student.config.router_aux_loss_coef = ROUTER_AUX_LOSS_COEF
    try:
        outputs = student(input_ids=input_ids, labels=input_ids, output_router_logits=True, use_cache=False)
    finally:
        student.config.router_aux_loss_coef = coef
    with torch.no_grad():
        teacher_logits = teacher(input_ids=input_ids, use_cache=False).logits[:, :-1]
    kl = distillation_kl(outputs.logits[:, :-1], teacher_logits).mean()
    return distillation_objective(outputs, kl, ROUTER_AUX_LOSS_COEF, kl_weight), kl.item()


def heal_folder_jointly(
    folder, teacher, input_ids, lr: float, *, dtype, max_shard_size, device=None, progress=True, kl_weight=KL_WEIGHT
) -> dict:
    """`heal_jointly` on the MoE folder `folder`, loaded in float32 on `device`; its weights are written again in
    `dtype` (shards of `max_shard_size`), into a sibling folder first and then moved over the old files, which the
    loaded model may still map. Returns the info; the caller records it in the config."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

    from ...checkpoints.writer import ShardedWriter, read_shapes

    folder, device = Path(folder), device or "cpu"
    student = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    info = heal_jointly(student, teacher.to(device, torch.float32), input_ids, lr, progress, kl_weight)
    shapes, state = read_shapes(folder), student.state_dict()
    staging = folder / ".joint-heal"
    staging.mkdir()
    try:
        writer = ShardedWriter(staging, shapes, dtype, max_shard_size)
        for name in shapes:
            writer.add(name, state[name])
        files = writer.close(total_parameters=sum(math.prod(shape) for shape in shapes.values()))
        for stale in folder.glob("model*.safetensors*"):  # shards may be cut elsewhere: no old file stays
            if stale.name not in files:
                stale.unlink()
        for file in files:
            (staging / file).replace(folder / file)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return info


JOINT_TEXT = ".joint-heal-text.jsonl"  # hidden: `llama-moe push` leaves it out
RECIPE = "recipes/pretrain/joint-heal.yaml"


def write_joint_text(path, input_ids: torch.Tensor, tokenizer) -> int:
    """The joint stage's `[B, S]` tokens as JSON lines of text (the recipes' `--domains` format): one document per
    piece between EOS tokens, so that the recipes' packing (each document followed by EOS) gives the stream again.
    Returns the documents written."""
    ids, eos = input_ids.flatten().tolist(), tokenizer.eos_token_id
    pieces, start = [], 0
    for position, token in enumerate(ids):
        if token == eos:
            pieces.append(ids[start:position])
            start = position + 1
    pieces.append(ids[start:])
    documents = [tokenizer.decode(piece) for piece in pieces if piece]
    with open(path, "w", encoding="utf-8") as file:
        file.writelines(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in documents)
    return len(documents)


def recipe_command(folder, text, recipe, sequences: int) -> str:
    """The `recipes/continual_pretrain.py` command that runs the joint stage `heal_jointly` would have run on
    `folder` (into `folder`-joint): the same batches of 4 sequences, steps, warm-up, learning rate and KL weight, on
    the stage's text `text` (`write_joint_text` of its `sequences`); the teacher is the folder's recorded source."""
    batches = math.ceil(sequences / BATCH_SEQUENCES)
    steps = batches - 1 if batches > 1 else 1  # the last batch held back
    flags = {
        "--config": RECIPE,
        "--model_name_or_path": str(folder),
        "--output_dir": f"{folder}-joint",
        "--domains": f"calibration={text}",
        "--seq_len": recipe.calibration_seq_len,
        "--max_steps": steps,
        "--warmup_steps": max(1, round(WARMUP_SHARE * steps)),
        "--learning_rate": recipe.joint_heal_lr,
        "--distill_alpha": recipe.joint_heal_kl_weight,
    }
    return "python recipes/continual_pretrain.py " + " ".join(f"{k} {shlex.quote(str(v))}" for k, v in flags.items())

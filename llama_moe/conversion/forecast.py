"""What a conversion will hold in memory, said before any weight is read, and a refusal where it will not fit.

Each stage's peak, from the plan's shapes (bytes; P = parameters, L = layers, H = hidden size, V = vocabulary,
N = calibration tokens, float32 compute):

    text         the whole dense model, P_dense x 4, when the dense model writes the calibration text (`builtin:chat`)
    calibration  the largest decoder layer x 4, the states N x H x 4 three times (input, output, gradient), a
                 gradient pass's kept layer inputs L x N x H x 4 (on disk instead when over a quarter of the free
                 memory: `--offload-dir`), one batch's logits and their gradient (batch x S x V x 12) and the MLP input
                 samples (samples x H x 4 per MoE layer)
    layer heal   the dense and the MoE layer x 4, the MoE block's AdamW state and gradient x 12, the healing states
                 (heal tokens x H x 4, five of them: input, attended, target, output and the dense stream)
    joint heal   `footprint.estimate_footprint` of the converted model trained whole with AdamW in float32
                 on batches of 4 calibration sequences, the dense model beside it as the teacher

The MLP input samples stay in memory until the layers are written, so the layer heal counts them too.

The process itself (interpreter, torch, tokenizer) adds `footprint.OVERHEAD`. `llama-moe convert` stops with one
line (exit 2) when a stage needs more than the free memory allows, naming the flags that would fit (`--force` runs
anyway), logs the forecast where a stage needs over half the free memory, and records it in `conversion_info`.
"""

import dataclasses

from ..footprint import GIB, HEADROOM, OVERHEAD, RunSettings, estimate_footprint, parameter_counts
from ..footprint import teacher_bytes as _teacher_bytes
from .calibration import SELF_MADE
from .healing.joint import BATCH_SEQUENCES as JOINT_BATCH
from .statistics import IN_MEMORY_SHARE

FP32 = 4
HEAL_STATES = 5  # [tokens, H] float32 tensors the layer healer holds at once
LOGIT_BYTES = 12  # float32 logits, their log-softmax and gradient, per vocabulary entry


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    peak: float  # bytes, the process overhead included
    remedy: str  # the flags that lower it


def forecast(plan, available: float) -> list[Stage]:
    """The stages `plan`'s conversion runs, each with its peak; `available`: the free memory, which decides whether
    a gradient pass's layer inputs stay in memory."""
    recipe, dense = plan.recipe, plan.dense_config
    counts = parameter_counts(dense)
    overhead = OVERHEAD["cpu"]
    stages = []
    reads_text = recipe.heal_tokens or recipe.joint_heal_tokens or recipe.calibration_tokens
    if recipe.calibration_data in SELF_MADE and reads_text:
        stages.append(Stage("text", overhead + FP32 * counts.total, "--calibration-data FILE (text of your own)"))
    samples = _samples(plan)
    stages.append(_calibration(plan, counts, available, overhead + samples))
    if recipe.heal_tokens:
        stages.append(_layer_heal(plan, counts, overhead + samples))
    if recipe.joint_heal_tokens:
        stages.append(_joint_heal(plan, counts))
    return stages


def _samples(plan) -> float:
    """The MLP input samples of every MoE layer (`--calibration-samples`)."""
    moe_layers = len(next(iter(plan.targets.values())).layers) if plan.targets else 0
    tokens = min(plan.recipe.calibration_samples, plan.recipe.calibration_tokens)
    return tokens * plan.dense_config.hidden_size * FP32 * moe_layers


def _calibration(plan, counts, available: float, overhead: float) -> Stage:
    r, dense = plan.recipe, plan.dense_config
    hidden, layers = dense.hidden_size, dense.num_hidden_layers
    states = r.calibration_tokens * hidden * FP32
    kept = layers * states
    kept = kept if kept <= available * IN_MEMORY_SHARE else 0.0  # spilled to disk beyond that
    logits = plan.run.calibration_batch_size * r.calibration_seq_len * dense.vocab_size * LOGIT_BYTES
    peak = overhead + FP32 * counts.largest_layer + 3 * states + kept + logits
    return Stage("calibration", peak, "--calibration-tokens, --calibration-samples, --offload-dir")


def _layer_heal(plan, counts, overhead: float) -> Stage:
    states = plan.recipe.heal_tokens * plan.dense_config.hidden_size * FP32
    peak = overhead + (2 * FP32 + 12) * counts.largest_layer + HEAL_STATES * states
    return Stage("layer heal", peak, "--heal-tokens")


def _joint_heal(plan, counts) -> Stage:
    student = parameter_counts(plan.config, plan.meta_model)
    seq_len = plan.recipe.calibration_seq_len
    settings = RunSettings(batch=JOINT_BATCH, seq_len=seq_len, checkpointing=False)
    teacher = _teacher_bytes(plan.dense_config, counts.total, FP32, JOINT_BATCH * seq_len)
    total = estimate_footprint(student, student.total, plan.config, settings, teacher, "cpu").total  # overhead in
    return Stage("joint heal", total, "--joint-heal-tokens 0 (then the distillation recipe, docs/training.md)")


def describe(stages: list[Stage], available: float) -> str:
    """One line: each stage's peak and the free memory."""
    shown = ", ".join(f"{stage.name} {stage.peak / GIB:.1f}" for stage in stages)
    return f"Memory forecast (GiB): {shown}; free {available / GIB:.1f}."


def check_forecast(stages: list[Stage], available: float, force: bool) -> None:
    """One ValueError when a stage's peak is over what may be planned of the free memory (unless `force`)."""
    over = [stage for stage in stages if stage.peak > HEADROOM * available]
    if over and not force:
        worst = max(over, key=lambda stage: stage.peak)
        raise ValueError(
            f"The {worst.name} stage needs about {worst.peak / GIB:.1f} GiB and {available / GIB:.1f} GiB is free: "
            f"lower {'; '.join(stage.remedy for stage in over)}, or pass --force to run anyway."
        )

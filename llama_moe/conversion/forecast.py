"""What a conversion will hold in memory, said before any weight is read, and a refusal where it will not fit.

Each stage's peak, from the plan's shapes (bytes; P = parameters, L = layers, H = hidden size, V = vocabulary,
N = calibration tokens, float32 compute):

    text         the whole dense model, P_dense x 4, when the dense model writes the calibration text (`builtin:chat`)
    calibration  (where a component asks for statistics or back-propagates) the largest decoder layer x 4, the states N x H x 4 three times (input, output, gradient), a
                 gradient pass's kept layer inputs L x N x H x 4 (on disk instead when over a quarter of the free
                 memory: `--offload-dir`), one batch's logits and their gradient (batch x S x V x 12) and the MLP input
                 samples (samples x H x 4 per MoE layer)
    layer heal   the dense layer as read, the converted one as written and in float32, the MoE block's Adam state
                 and gradient x 12, the healing states (heal tokens x H x 4, five of them: input, attended, target,
                 output and the dense stream)
    joint heal   `footprint.estimate_footprint` of the converted model trained whole with AdamW in float32
                 on batches of 4 calibration sequences, the dense model beside it as the teacher

The MLP input samples stay in memory until the layers are written, so the layer heal counts them too.

What each stage computes (float32 FLOPs; F = a dense decoder layer's forward per token, 2 x its parameters + 2 x S x H
for causal attention; A = an MoE MLP's active parameters; E = heal epochs; T = heal tokens; J = joint heal tokens):

    calibration  N x L x F for the statistics pass; each method that back-propagates (`gradient_pass`) adds a pass
                 keeping the layer inputs and one back down, 3 x N x L x F, and the loss's gradient, 4 x N x H x V
    layer heal   T x L x F for the states and targets (twice under `heal_target: stream`), and per MoE layer
                 T x A x (6 E + 3): E passes of Adam's forward and backward, the error before and after, the outputs;
                 with the routing term (`heal_routing_weight`), E x its target on every batch: every routed
                 expert's output error (`gmoefication.energy_flops`)
    joint heal   J x (6 x the student's active parameters + 2 x the dense model's): forward and backward of the
                 student, forward of the teacher
    text         M x 2 x P_dense, M the tokens the dense model writes: as many as the conversion reads (the
                 calibration's, or the heals' together where more), three fifths of them where its texts go in turn
                 with `builtin:mixed`'s documents, and `builtin:chat-self`'s sampled texts counted as many again;
                 nothing cached counted (a second conversion of the model makes only what the first did not)

A stage's expected time is its FLOPs over the machine's float32 matmul rate (`matmul_rate`: the fastest product of
the model's hidden size by up to 1024 of its MLP's columns on the compute device, over a second where the run is
long), divided by the share of that rate the stage's code reaches (`EFFICIENCY`, measured: see there).

What each stage holds on disk at its peak (bytes), checked against the free space where it writes:

    calibration  the kept layer inputs where they spill (`--offload-dir`, else the temporary folder)
    write        the output's weights in the output dtype (a stage of its own only when nothing heals)
    layer heal   the output, and beside it the healing progress kept for a resume: each layer's healed MLP in
                 float32 and the heal states after it (`.NAME.healing`)
    joint heal   the output twice (the healed weights are written beside the old ones, then moved over them) and the
                 healing progress

The process itself (interpreter, torch, tokenizer) adds `footprint.OVERHEAD`. `llama-moe convert` stops with one
line (exit 2) when a stage needs more than the free memory or disk allows, naming the flags that would fit (`--force`
runs anyway; a joint stage over the free memory is left to a training run instead, `pipeline.defer_joint_stage`), logs the forecast where the run is expected to take 10 s or more or a stage needs over half the free
memory, and records the memory and disk in `conversion_info`.
"""

import dataclasses
import functools
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path

from ..footprint import GIB, HEADROOM, OVERHEAD, RunSettings, estimate_footprint, parameter_counts
from ..footprint import teacher_bytes as _teacher_bytes
from .calibration import SELF_MADE, conversation_tokens, text_tokens
from .healing.joint import BATCH_SEQUENCES as JOINT_BATCH
from .registry import count_parameters
from .statistics import IN_MEMORY_SHARE
from .target import MLP

logger = logging.getLogger(__name__)
FP32 = 4
SAY_SECONDS = 10  # stages expected to take less go without their forecast line
HEAL_STATES = 5  # [tokens, H] float32 tensors the layer healer holds at once
LOGIT_BYTES = 12  # float32 logits, their log-softmax and gradient, per vocabulary entry


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    peak: float  # bytes, the process overhead included
    remedy: str  # the flags that lower it
    disk: float = 0.0  # bytes the stage holds on disk at its peak
    folder: Path | None = None  # where it writes them
    flops: float = 0.0  # float32 FLOPs of its compute (0: not forecast)


def forecast(plan, available: float, dtype_bytes: int, requested: bool = True) -> list[Stage]:
    """The stages `plan`'s conversion runs, each with its peak memory and disk; `available`: the free memory, which
    decides whether a gradient pass's layer inputs stay in memory; `dtype_bytes`: the output's bytes per weight;
    `requested`: the components asked for calibration statistics (else only a gradient pass calibrates)."""
    recipe, dense = plan.recipe, plan.dense_config
    counts = parameter_counts(dense)
    overhead = OVERHEAD["cpu"]
    stages = []
    calibrates = requested or any(method.gradient_pass for method, _ in plan.components.values())
    if recipe.calibration_data in SELF_MADE and (recipe.heal_tokens or recipe.joint_heal_tokens or calibrates):
        stages.append(_text(counts, recipe, text_tokens(recipe)))
    samples = _samples(plan) if requested else 0.0
    if calibrates:
        stages.append(_calibration(plan, counts, available, overhead + samples))
    output = dtype_bytes * sum(math.prod(shape) for shape in plan.expected.values())
    folder = _output_parent(plan)
    if recipe.heal_tokens:
        progress = _healing_progress(plan)
        stages.append(_layer_heal(plan, counts, overhead + samples, output + progress, folder, dtype_bytes))
    else:
        memory = overhead + samples + 2 * FP32 * counts.largest_layer
        progress = 0.0
        stages.append(Stage("write", memory, "", output, folder))
    if recipe.joint_heal_tokens:
        stages.append(_joint_heal(plan, counts, 2 * output + progress, folder))
    return stages


def heal_forecast(plan, dtype_bytes: int) -> list[Stage]:
    """`llama-moe heal`'s stages (`plan`: the folder's recipe with the heal settings, `run.output` the heal's
    output): the text the teacher makes, where the recipe's data is `builtin:chat` and the like, and the layer heal,
    its output and resume files on disk."""
    counts = parameter_counts(plan.dense_config)
    stages = [_text(counts, plan.recipe, plan.recipe.heal_tokens)] if plan.recipe.calibration_data in SELF_MADE else []
    output = dtype_bytes * sum(math.prod(shape) for shape in plan.expected.values())
    disk = output + _healing_progress(plan)
    return stages + [_layer_heal(plan, counts, OVERHEAD["cpu"], disk, _output_parent(plan), dtype_bytes)]


def _text(counts, recipe, needed: int) -> Stage:
    """The dense model writing `needed` tokens of `recipe.calibration_data` (those it makes itself: `SELF_MADE`)."""
    _, mixed = SELF_MADE[recipe.calibration_data]
    written = needed if mixed is None else conversation_tokens(needed) * (2 if mixed == "self" else 1)
    remedy = "--calibration-data FILE (text of your own)"
    return Stage("text", OVERHEAD["cpu"] + FP32 * counts.total, remedy, flops=2.0 * written * counts.total)


def _output_parent(plan) -> Path | None:
    return Path(plan.run.output).expanduser().resolve().parent if plan.run.output else None


def _samples(plan) -> float:
    """The MLP input samples of every MoE layer (`--calibration-samples`)."""
    moe_layers = len(next(iter(plan.targets.values())).layers) if plan.targets else 0
    tokens = min(plan.recipe.calibration_samples, plan.recipe.calibration_tokens)
    return tokens * plan.dense_config.hidden_size * FP32 * moe_layers


def _calibration(plan, counts, available: float, overhead: float) -> Stage:
    r, dense, run = plan.recipe, plan.dense_config, plan.run
    hidden, layers = dense.hidden_size, dense.num_hidden_layers
    states = r.calibration_tokens * hidden * FP32
    kept = layers * states
    spilled = run.offload_dir is not None or kept > available * IN_MEMORY_SHARE
    logits = run.calibration_batch_size * r.calibration_seq_len * dense.vocab_size * LOGIT_BYTES
    peak = overhead + FP32 * counts.largest_layer + 3 * states + (0.0 if spilled else kept) + logits
    remedy = "--calibration-tokens, --calibration-samples, --offload-dir"
    passes = sum(method.gradient_pass for method, _ in plan.components.values())
    flops = r.calibration_tokens * (layers * _layer_flops(plan, counts) * (1 + 3 * passes))
    flops += passes * 4 * r.calibration_tokens * hidden * dense.vocab_size
    folder = Path(run.offload_dir or tempfile.gettempdir())
    # Only a gradient pass keeps the inputs; the disk counts them wherever they would spill.
    return Stage("calibration", peak, remedy, kept if spilled else 0.0, folder, flops)


def _layer_flops(plan, counts) -> float:
    """A dense decoder layer's forward per token: its matmuls, and causal attention's scores and weighted sum."""
    return 2 * counts.largest_layer + 2 * plan.recipe.calibration_seq_len * plan.dense_config.hidden_size


def _active_mlp(plan, layer_idx: int) -> int:
    """The parameters a token uses in layer `layer_idx`'s (MoE) MLP."""
    prefix = f"model.layers.{layer_idx}.mlp."
    return count_parameters(plan.config, {k: v for k, v in plan.expected.items() if k.startswith(prefix)})[1]


def _routing_target_flops(plan, layer_idx: int) -> float:
    """One epoch of the heal's routing target in layer `layer_idx`: `deviation_energy` on each batch."""
    from .routers.selector.gmoefication import energy_flops

    experts, hidden, inner = plan.expected[f"model.layers.{layer_idx}.mlp.experts.down_proj"]
    tokens, batch = plan.recipe.heal_tokens, plan.recipe.heal_batch_tokens
    full, rest = divmod(tokens, batch)
    return full * energy_flops(batch, hidden, inner, experts) + energy_flops(rest, hidden, inner, experts)


def _healing_progress(plan) -> float:
    """The layer healer's files at their largest: every layer's healed MLP in float32, the heal states twice."""
    mlp = sum(math.prod(shape) for name, shape in plan.expected.items() if ".mlp." in name)
    return FP32 * mlp + 2 * _streams(plan.recipe) * plan.recipe.heal_tokens * plan.dense_config.hidden_size * FP32


def _streams(recipe) -> int:
    """The hidden-state streams the layer healer carries: the dense model's own beside the healed one's under
    `heal_target: stream`."""
    return 2 if recipe.heal_target == "stream" else 1


def _layer_heal(plan, counts, overhead: float, disk: float, folder, dtype_bytes: int) -> Stage:
    r, layers = plan.recipe, plan.dense_config.num_hidden_layers
    states = r.heal_tokens * plan.dense_config.hidden_size * FP32
    source_bytes = getattr(plan.dense_config.dtype, "itemsize", FP32)  # a torch dtype, or unset: float32
    peak = overhead + (source_bytes + dtype_bytes + FP32 + 12) * counts.largest_layer + HEAL_STATES * states
    moe = plan.targets[MLP].layers if MLP in plan.targets else ()
    flops = _streams(r) * r.heal_tokens * layers * _layer_flops(plan, counts)
    flops += r.heal_tokens * (6 * r.heal_epochs + 3) * sum(_active_mlp(plan, i) for i in moe)
    if r.heal_routing_weight:  # the routing term's target: every routed expert's output on every batch
        flops += r.heal_epochs * sum(_routing_target_flops(plan, i) for i in moe)
    return Stage("layer heal", peak, "--heal-tokens", disk, folder, flops)


def _joint_heal(plan, counts, disk: float, folder) -> Stage:
    student = parameter_counts(plan.config, plan.meta_model)
    seq_len = plan.recipe.calibration_seq_len
    settings = RunSettings(batch=JOINT_BATCH, seq_len=seq_len, checkpointing=False)
    teacher = _teacher_bytes(plan.dense_config, counts.total, FP32, JOINT_BATCH * seq_len)
    total = estimate_footprint(student, student.total, plan.config, settings, teacher, "cpu").total  # overhead in
    flops = plan.recipe.joint_heal_tokens * (6 * student.active + 2 * counts.total)
    return Stage("joint heal", total, "", disk, folder, flops)  # too large: left to a training run, not refused


# The share of the matmul rate each stage's code reaches: its attention, norms, routing, optimizer and the
# transfers between layers are not matmuls. Set from benchmarks/memory/forecast_check.py on SmolLM2-135M and two
# layers of Llama-3-8B's shape; the whole 8B shape confirms it within 17%, while the layer heal at 135M comes out
# 1.35x too long: its Adam steps cost by the weights, not the FLOPs (docs/benchmarks.md). The text stage's is set on
# two 135M runs alone (0.17 and 0.19 reached; greedy decoding 32 rows at a time, bound there by each step's
# overhead): larger models may reach more, and then take less than forecast.
EFFICIENCY = {"text": 0.18, "calibration": 0.6, "layer heal": 0.45, "joint heal": 0.5}


@functools.cache
def matmul_rate(device: str, rows: int, inner: int, cols: int, budget: float) -> float:
    """Float32 FLOP/s of `[rows, inner] @ [inner, cols]` on `device`: the fastest of the products timed over about
    `budget` seconds after one warm-up product (once per process, shape and budget). The fastest, not the mean: on a
    shared 2-core machine one product's rate swings by a third from the next."""
    import torch

    a = torch.randn(rows, inner, device=device)
    b = torch.randn(inner, cols, device=device)
    (a @ b).sum().item()  # warm-up; .item() waits for a GPU
    fastest, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < budget:
        began = time.perf_counter()
        (a @ b).sum().item()
        fastest = min(fastest, time.perf_counter() - began)
    return 2 * rows * inner * cols / fastest


def seconds(stage: Stage, rate: float) -> float | None:
    """The stage's expected time at `rate` FLOP/s (None where it is not forecast)."""
    return stage.flops / (rate * EFFICIENCY[stage.name]) if stage.flops else None


def describe(stages: list[Stage], available: float, rate: float) -> str:
    """One line: each stage's peak memory and expected time, the free memory, and what the stages write where."""
    shown = []
    for stage in stages:
        expected = seconds(stage, rate)
        shown.append(f"{stage.name} {stage.peak / GIB:.1f} GiB" + (f" ~{_duration(expected)}" if expected else ""))
    written = [f"{stage.name} {stage.disk / GIB:.1f} GiB in {stage.folder}" for stage in stages if stage.disk]
    return f"Forecast: {', '.join(shown)} (free {available / GIB:.1f} GiB)" + (
        f"; on disk: {', '.join(written)}." if written else "."
    )


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def report(stages: list[Stage], available: float, device: str, dense_config) -> float:
    """Log the forecast line (`describe`): at INFO where the stages are expected to take `SAY_SECONDS` or more or
    one needs over half the free memory, else at DEBUG. Returns the matmul rate the times were forecast at: a glance
    of 50 ms, and where that says the run takes over a minute the rate measured over a second (a short dip of a shared
    machine would set the forecast for an hour)."""
    # at most 1024 of the MLP's columns: dozens of products a second at any width (8B's whole MLP: one in 0.4 s)
    shape = (512, dense_config.hidden_size, min(dense_config.intermediate_size, 1024))
    rate = matmul_rate(device, *shape, budget=0.05)
    if sum(seconds(stage, rate) or 0.0 for stage in stages) > 6 * SAY_SECONDS:
        rate = matmul_rate(device, *shape, budget=1.0)
    expected = sum(seconds(stage, rate) or 0.0 for stage in stages)
    worth_saying = expected >= SAY_SECONDS or max(stage.peak for stage in stages) > available / 2
    logger.log(logging.INFO if worth_saying else logging.DEBUG, describe(stages, available, rate))
    return rate


def disk_free(folder: Path) -> float:
    """Free bytes on the file system `folder` is (or will be) on: its nearest existing parent's."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return float(shutil.disk_usage(folder).free)


def check_forecast(stages: list[Stage], available: float, force: bool) -> None:
    """One ValueError when a stage's peak is over what may be planned of the free memory, or its files over the free
    disk where it writes them (unless `force`)."""
    if force:
        return
    over = [stage for stage in stages if stage.peak > HEADROOM * available]
    if over:
        worst = max(over, key=lambda stage: stage.peak)
        remedies = "; ".join(stage.remedy for stage in over if stage.remedy)
        fix = f"lower {remedies}" if remedies else "run it where more memory is free"
        raise ValueError(
            f"The {worst.name} stage needs about {worst.peak / GIB:.1f} GiB and {available / GIB:.1f} GiB is free: "
            f"{fix}, or pass --force to run anyway."
        )
    for stage in stages:
        if stage.disk and stage.disk > (free := disk_free(stage.folder)):
            where = "--offload-dir on a larger disk" if stage.name == "calibration" else "--output on a larger disk"
            raise ValueError(
                f"The {stage.name} stage writes about {stage.disk / GIB:.1f} GiB in {stage.folder} and "
                f"{free / GIB:.1f} GiB is free there: pass {where}, or --force to run anyway."
            )

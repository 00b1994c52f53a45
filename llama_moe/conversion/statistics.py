"""Calibration statistics: what one pass of the dense model over the calibration tokens records.

    LayerCalibration      per MLP: a sample of its inputs, its mean activation, and (gradient passes) the neuron
                          importance per token group
    AttentionCalibration  per attention block: the normal equations of the attention-router fit (`attention_fit`)
    sequence embeddings   per calibration sequence: the mean final hidden state (to group the texts)

`collect_calibration` records any of these in a single pass, with hooks on one decoder layer at a time; memory is
bounded whatever the number of calibration tokens (running sums, and a fixed-size seeded sample of the MLP inputs) and
whatever the depth (one layer's weights, the sequences' states on the CPU).
"""

import contextlib
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .routers.fit.attention_fit import AttentionCalibration, AttentionFitAccumulator

logger = logging.getLogger(__name__)

IN_MEMORY_SHARE = 0.25  # of the free memory a gradient pass's kept layer inputs may take; beyond, they spill
DEFAULT_CALIBRATION_SAMPLES = 8192  # MLP inputs kept per layer (`--calibration-samples`)
# `token_groups(layer_idx, mlp_inputs [T, H]) -> group ids [T]`: buckets the importance of each token.
TokenGroups = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class LayerCalibration:
    """Calibration statistics of one decoder layer's MLP (all float32 on CPU).

    hidden_states:   `[n, H]` sampled MLP inputs (post_attention_layernorm outputs), n <= max_hidden_samples.
    mean_activation: `[I]` mean over all calibration tokens of the SwiGLU activation h = silu(x W_gate) * (x W_up).
    importance:      `[G, I]` mean over the tokens of group g of |h * dL/dh| (first-order Taylor importance);
                     None when collected without gradients.
    group_counts:    `[G]` tokens per group (None without gradients).
    """

    hidden_states: torch.Tensor
    mean_activation: torch.Tensor
    importance: torch.Tensor | None = None
    group_counts: torch.Tensor | None = None


@dataclass
class CalibrationStatistics:
    """What `collect_calibration` recorded: per MLP layer, per attention layer, and per calibration sequence."""

    mlp: dict[int, LayerCalibration] = field(default_factory=dict)
    attention: dict[int, AttentionCalibration] = field(default_factory=dict)
    sequence_embeddings: torch.Tensor | None = None  # [B, H] float32


class _LayerAccumulator:
    """Hooks on one dense MLP: `mlp` (inputs) and `mlp.down_proj` (activations h and, in backward, dL/dh)."""

    def __init__(self, layer_idx, mlp, num_groups, token_groups, sequence_groups, with_gradients, sample, seq_len):
        self.layer_idx = layer_idx
        self.num_groups = num_groups
        self.token_groups = token_groups
        self.sequence_groups = sequence_groups
        self.with_gradients = with_gradients
        self.sample, self.seq_len = sample, seq_len  # [n] global token positions of the input sample
        self.hidden_size = mlp.down_proj.out_features
        self.sample_rows: torch.Tensor | None = None  # rows of the current batch to keep
        self.batch_groups: torch.Tensor | None = None  # [T] group ids of the current batch, from sequence_groups
        # Filled in place, batch by batch: appending pieces and concatenating them at the end would leave the freed
        # pieces in the allocator's heap and about double the resident memory.
        self.samples = torch.empty(sample.numel(), self.hidden_size)
        self.num_sampled = 0
        self.activation_sum = torch.zeros(mlp.down_proj.in_features, dtype=torch.float64)
        self.importance_sum = torch.zeros(num_groups, mlp.down_proj.in_features, dtype=torch.float64)
        self.group_counts = torch.zeros(num_groups, dtype=torch.long)
        self.num_tokens = 0
        self.groups: torch.Tensor | None = None  # [T] group ids of the current batch
        self.handles = [
            mlp.register_forward_pre_hook(self._mlp_input),
            mlp.down_proj.register_forward_pre_hook(self._activation),
        ]

    def start_batch(self, first_sequence: int, num_sequences: int) -> None:
        first, last = first_sequence * self.seq_len, (first_sequence + num_sequences) * self.seq_len
        self.sample_rows = self.sample[(self.sample >= first) & (self.sample < last)] - first
        if self.sequence_groups is not None:
            groups = self.sequence_groups[first_sequence : first_sequence + num_sequences]
            self.batch_groups = groups.repeat_interleave(self.seq_len)

    def _mlp_input(self, module, args):
        x = args[0].detach().flatten(0, -2)  # [T, H]
        if self.sample_rows is not None and self.sample_rows.numel():
            end = self.num_sampled + self.sample_rows.numel()
            self.samples[self.num_sampled : end] = x[self.sample_rows.to(x.device)].float().cpu()
            self.num_sampled = end
        if self.with_gradients:
            self.groups = self._token_groups(x)

    def _token_groups(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_groups is not None:
            return self.batch_groups.to(x.device)
        if self.token_groups is None:
            return torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        with torch.no_grad():
            groups = self.token_groups(self.layer_idx, x).to(device=x.device, dtype=torch.long)
        if groups.shape != (x.shape[0],) or not bool(((groups >= 0) & (groups < self.num_groups)).all()):
            raise ValueError(f"token_groups must return {x.shape[0]} group ids in [0, {self.num_groups}).")
        return groups

    def _activation(self, module, args):
        h = args[0]  # [B, S, I]
        flat = h.detach().flatten(0, -2)
        self.activation_sum += flat.float().sum(0).double().cpu()
        self.num_tokens += flat.shape[0]
        if self.with_gradients and h.requires_grad:
            groups = self.groups
            h.register_hook(lambda grad: self._accumulate_importance(flat, grad.flatten(0, -2), groups))

    def _accumulate_importance(self, h, grad, groups):
        scores = (h.float() * grad.float()).abs()  # [T, I]
        batch_sum = torch.zeros(self.num_groups, scores.shape[1], device=scores.device).index_add_(0, groups, scores)
        self.importance_sum += batch_sum.double().cpu()
        self.group_counts += torch.bincount(groups, minlength=self.num_groups).cpu()

    def result(self) -> LayerCalibration:
        hidden = self.samples[: self.num_sampled]
        importance = counts = None
        if self.with_gradients:
            counts = self.group_counts
            importance = (self.importance_sum / counts.clamp(min=1)[:, None]).float()
        mean = (self.activation_sum / max(self.num_tokens, 1)).float()
        return LayerCalibration(hidden_states=hidden, mean_activation=mean, importance=importance, group_counts=counts)

    def remove(self):
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def _frozen_eval(model):
    """The model in eval mode with parameters that need no gradient; restored afterwards."""
    was_training = model.training
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    model.eval()
    model.requires_grad_(False)
    try:
        yield
    finally:
        for name, param in model.named_parameters():
            param.requires_grad_(requires_grad[name])
        model.train(was_training)


def collect_calibration(
    model,  # a loaded dense model, or a `DenseSource` (its layers read one at a time)
    input_ids: torch.LongTensor,  # [B, S]
    layers=(),
    *,
    attention_experts: dict[int, int] | None = None,
    sequence_embeddings: bool = False,
    with_gradients: bool = False,
    token_groups: TokenGroups | None = None,
    sequence_groups: torch.Tensor | None = None,
    num_groups: int = 1,
    max_hidden_samples: int = DEFAULT_CALIBRATION_SAMPLES,
    batch_size: int = 4,
    device: torch.device | str | None = None,
    seed: int = 0,
    progress: bool = True,
    offload_dir: str | None = None,
) -> CalibrationStatistics:
    """The dense model over the calibration sequences, a decoder layer at a time (`layerwise.DecoderLayers`: one
    layer in memory, the sequences' states on the CPU between layers), recording in the same pass:

    - for the MLPs of `layers`: `LayerCalibration` (input sample, mean activation); with `with_gradients`, the summed
      next-token loss is back-propagated (parameters get no gradients) and each token's |h * dL/dh| is added to its
      group: `token_groups(layer_idx, mlp_inputs [T, H]) -> [T]` (e.g. a router's argmax), or `sequence_groups [B]`
      (one group per sequence), else group 0. A summed loss makes the statistics independent of `batch_size`;
    - for the attention blocks of `attention_experts` (layer -> number of attention experts): the router fit's
      normal equations;
    - with `sequence_embeddings`: each sequence's mean final hidden state.

    Gradients: a forward pass keeps each layer's input (`_LayerInputs`), a backward pass reruns one layer at a time;
    the sample's token positions are seeded; a source's layers run on `device`, else CUDA when available."""
    from .layerwise import decoder_layers

    if token_groups is not None and sequence_groups is not None:
        raise ValueError("Pass token_groups or sequence_groups, not both.")
    runner = decoder_layers(model, device)
    accumulators = _MLPAccumulators(
        runner.config,
        layers,
        input_ids,
        sequence_groups,
        token_groups,
        num_groups,
        with_gradients,
        max_hidden_samples,
        seed,
    )
    with _frozen_eval(runner.model) if runner.model is not None else contextlib.nullcontext():
        pass_ = _Pass(runner, input_ids, batch_size, progress)
        states, attention, inputs = pass_.forward(
            None if with_gradients else accumulators,
            attention_experts or {},
            keep_inputs=with_gradients,
            to_the_top=with_gradients or sequence_embeddings,
            offload_dir=offload_dir,
        )
        embeddings = pass_.sequence_embeddings(states) if sequence_embeddings else None
        if with_gradients:
            pass_.backward(accumulators, states, inputs)
    return CalibrationStatistics(mlp=accumulators.results, attention=attention, sequence_embeddings=embeddings)


class _MLPAccumulators:
    """The `_LayerAccumulator` of each requested MLP, made when its layer runs, and their results by layer."""

    def __init__(
        self, config, layers, input_ids, sequence_groups, token_groups, num_groups, with_gradients, max_samples, seed
    ):
        self.layers = sorted(set(layers))
        bad = [i for i in self.layers if not 0 <= i < config.num_hidden_layers]
        if bad:
            raise ValueError(f"Calibration layers {bad} are outside 0..{config.num_hidden_layers - 1}.")
        num_sequences, self.seq_len = input_ids.shape
        if sequence_groups is not None:
            sequence_groups = torch.as_tensor(sequence_groups, dtype=torch.long)
            if sequence_groups.shape != (num_sequences,):
                raise ValueError(f"sequence_groups must hold one group id per sequence ({num_sequences}).")
        self.groups = (num_groups, token_groups, sequence_groups, with_gradients)
        # Fixed token positions for the hidden-state sample: [n] sorted global indices.
        generator = torch.Generator().manual_seed(seed)
        self.sample = torch.randperm(num_sequences * self.seq_len, generator=generator)[:max_samples].sort().values
        self.results: dict[int, LayerCalibration] = {}

    def attach(self, layer_idx: int, layer) -> _LayerAccumulator | None:
        if layer_idx not in self.layers:
            return None
        num_groups, token_groups, sequence_groups, with_gradients = self.groups
        return _LayerAccumulator(
            layer_idx, layer.mlp, num_groups, token_groups, sequence_groups, with_gradients, self.sample, self.seq_len
        )

    def done(self, accumulator: _LayerAccumulator | None) -> None:
        if accumulator is not None:
            accumulator.remove()
            self.results[accumulator.layer_idx] = accumulator.result()


class _LayerInputs:
    """Each decoder layer's input `[B, S, H]` in a gradient pass: kept in memory, or in a folder of safetensors files
    (`offload_dir`, else a temporary folder) when all of them would take more than a quarter of the free memory (a
    cgroup's limit counted, as the forecast counts it)."""

    def __init__(self, num_layers: int, states: torch.Tensor, offload_dir: str | None):
        from ..devices import available_bytes

        size = num_layers * states.numel() * states.element_size()
        spill = offload_dir is not None or size > available_bytes("cpu") * IN_MEMORY_SHARE
        self.folder = tempfile.TemporaryDirectory(prefix="calibration-", dir=offload_dir) if spill else None
        if spill:
            logger.info(
                "Calibration: the %d layers' inputs (%.1f GB) go to %s.", num_layers, size / 1e9, self.folder.name
            )
        self.kept: dict[int, torch.Tensor] = {}

    def put(self, layer_idx: int, states: torch.Tensor) -> None:
        if self.folder is None:
            self.kept[layer_idx] = states
        else:
            save_file({"states": states.contiguous()}, Path(self.folder.name) / f"{layer_idx}.safetensors")

    def pop(self, layer_idx: int) -> torch.Tensor:
        if self.folder is None:
            return self.kept.pop(layer_idx)
        return load_file(Path(self.folder.name) / f"{layer_idx}.safetensors")["states"]

    def close(self) -> None:
        if self.folder is not None:
            self.folder.cleanup()


class _Pass:
    """One calibration pass over `input_ids [B, S]`, `batch_size` sequences at a time, a layer at a time."""

    def __init__(self, runner, input_ids: torch.Tensor, batch_size: int, progress: bool):
        self.runner, self.input_ids, self.batch_size, self.progress = runner, input_ids, batch_size, progress
        self.num_layers = runner.config.num_hidden_layers

    def forward(self, mlp, attention_experts: dict, keep_inputs: bool, to_the_top: bool, offload_dir):
        """(the states after the last layer run, the attention statistics, each layer's input when `keep_inputs`);
        the layers above the last one anything needs are not run."""
        needed = [*(mlp.layers if mlp else ()), *attention_experts]
        last = self.num_layers - 1 if to_the_top else max(needed, default=-1)
        states = self.runner.embed(self.input_ids)
        inputs = _LayerInputs(last + 1, states, offload_dir) if keep_inputs else None
        attention = {}
        for layer_idx in tqdm(range(last + 1), desc="Calibrating", unit="layer", disable=not self.progress):
            layer = self.runner.layer(layer_idx)
            accumulator = mlp.attach(layer_idx, layer) if mlp else None
            fit = None
            if layer_idx in attention_experts:
                fit = AttentionFitAccumulator(layer.self_attn, attention_experts[layer_idx])
            if inputs is not None:
                inputs.put(layer_idx, states)
            try:
                before = accumulator.start_batch if accumulator else None
                with torch.no_grad():
                    states = self.runner.run(layer, layer_idx, states, self.batch_size, before)
            finally:
                if mlp:
                    mlp.done(accumulator)
                if fit is not None:
                    attention[layer_idx] = fit.result()
                    fit.remove()
            self.runner.release(layer)
        return states, attention, inputs

    def batches(self, *tensors):
        """`(first sequence, batch of each tensor)` over the sequences."""
        return zip(range(0, self.input_ids.shape[0], self.batch_size), *(t.split(self.batch_size) for t in tensors))

    @torch.no_grad()
    def sequence_embeddings(self, states: torch.Tensor) -> torch.Tensor:
        """`[B, H]` each sequence's mean final hidden state (after the final norm)."""
        norm, device, dtype = self.runner.final_norm(), self.runner.device, self.runner.dtype
        return torch.cat([norm(batch.to(device, dtype)).float().mean(dim=1).cpu() for _, batch in self.batches(states)])

    def backward(self, mlp, states: torch.Tensor, inputs: _LayerInputs) -> None:
        """The summed next-token loss back-propagated from the top, one layer rerun at a time, down to the lowest
        layer whose MLP is recorded."""
        try:
            grads = self._loss_grads(states)
            lowest = min(mlp.layers, default=self.num_layers)
            steps = tqdm(
                reversed(range(lowest, self.num_layers)),
                total=self.num_layers - lowest,
                desc="Calibrating (gradients)",
                unit="layer",
                disable=not self.progress,
            )
            for layer_idx in steps:
                layer = self.runner.layer(layer_idx)
                accumulator = mlp.attach(layer_idx, layer)
                try:
                    grads = self._layer_grads(layer, layer_idx, inputs.pop(layer_idx), grads, accumulator)
                finally:
                    mlp.done(accumulator)
                self.runner.release(layer)
        finally:
            inputs.close()

    def _loss_grads(self, states: torch.Tensor) -> torch.Tensor:
        """`[B, S, H]` dL/dh of the final hidden states, L the summed next-token cross-entropy."""
        norm, weight = self.runner.final_norm(), self.runner.lm_head_weight()
        device, dtype = self.runner.device, self.runner.dtype
        grads = []
        for _, batch, ids in self.batches(states, self.input_ids):
            hidden = batch.to(device, dtype).requires_grad_(True)
            logits = F.linear(norm(hidden), weight.to(dtype))
            targets = ids[:, 1:].flatten().to(device)
            F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets, reduction="sum").backward()
            grads.append(hidden.grad.to("cpu", torch.float32))
        return torch.cat(grads)

    def _layer_grads(self, layer, layer_idx: int, inputs, grads, accumulator) -> torch.Tensor:
        """dL/d(the layer's input) from dL/d(its output), the layer rerun on its saved input batch by batch."""
        device, dtype = self.runner.device, self.runner.dtype
        below = []
        for start, batch, grad in self.batches(inputs, grads):
            if accumulator is not None:
                accumulator.start_batch(start, batch.shape[0])
            hidden = batch.to(device, dtype).requires_grad_(True)
            output = self.runner.call(layer, layer_idx, hidden)
            output.backward(grad.to(device, output.dtype))
            below.append(hidden.grad.to("cpu", torch.float32))
        return torch.cat(below)

"""Calibration statistics: what one pass of the dense model over the calibration tokens records.

    LayerCalibration      per MLP: a sample of its inputs, its mean activation, and (gradient passes) the neuron
                          importance per token group
    AttentionCalibration  per attention block: the normal equations of the attention-router fit (`attention_fit`)
    sequence embeddings   per calibration sequence: the mean final hidden state (to group the texts)

`collect_calibration` records any of these in a single pass, with hooks; memory is bounded whatever the number of
calibration tokens (running sums, and a fixed-size seeded sample of the MLP inputs).
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .routers.fit.attention_fit import AttentionCalibration, AttentionFitAccumulator

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


class _EmbeddingAccumulator:
    """Hook on the final norm: each sequence's mean final hidden state."""

    def __init__(self, norm: torch.nn.Module):
        self.rows: list[torch.Tensor] = []
        self.handles = [norm.register_forward_hook(self._record)]

    def _record(self, module, args, output):
        self.rows.append(output.detach().float().mean(dim=1).cpu())

    def result(self) -> torch.Tensor:
        return torch.cat(self.rows)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _base_model(model):
    return getattr(model, model.base_model_prefix, model)


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
    model,
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
) -> CalibrationStatistics:
    """One pass of a dense LLaMA model over the calibration sequences, recording in the same pass:

    - for the MLPs of `layers`: `LayerCalibration` (input sample, mean activation); with `with_gradients`, the summed
      next-token loss is back-propagated (parameters get no gradients) and each token's |h * dL/dh| is added to its
      group: `token_groups(layer_idx, mlp_inputs [T, H]) -> [T]` (e.g. a router's argmax), or `sequence_groups [B]`
      (one group per sequence), else group 0. A summed loss makes the statistics independent of `batch_size`;
    - for the attention blocks of `attention_experts` (layer -> number of attention experts): the router fit's
      normal equations;
    - with `sequence_embeddings`: each sequence's mean final hidden state.

    The MLP input sample takes the same (seeded) token positions whatever the batch size. Runs on `device` (the model
    is moved there), else on the model's device.
    """
    if token_groups is not None and sequence_groups is not None:
        raise ValueError("Pass token_groups or sequence_groups, not both.")
    if device is not None:
        model.to(device)
    device = next(model.parameters()).device
    base = _base_model(model)
    mlp = _mlp_accumulators(
        base, layers, input_ids, sequence_groups, token_groups, num_groups, with_gradients, max_hidden_samples, seed
    )
    attention = {i: AttentionFitAccumulator(base.layers[i].self_attn, e) for i, e in (attention_experts or {}).items()}
    embeddings = _EmbeddingAccumulator(base.norm) if sequence_embeddings else None
    accumulators = [*mlp.values(), *attention.values(), *([embeddings] if embeddings else [])]
    try:
        with _frozen_eval(model):
            batches = range(0, input_ids.shape[0], batch_size)
            for start in tqdm(batches, desc="Calibrating", unit="batch", disable=not progress):
                batch = input_ids[start : start + batch_size].to(device)
                for acc in mlp.values():
                    acc.start_batch(start, batch.shape[0])
                _forward(model, batch, with_gradients)
    finally:
        for acc in accumulators:
            acc.remove()
    return CalibrationStatistics(
        mlp={i: acc.result() for i, acc in mlp.items()},
        attention={i: acc.result() for i, acc in attention.items()},
        sequence_embeddings=embeddings.result() if embeddings else None,
    )


def _mlp_accumulators(
    base, layers, input_ids, sequence_groups, token_groups, num_groups, with_gradients, max_hidden_samples, seed
) -> dict:
    layers = sorted(set(layers))
    bad = [i for i in layers if not 0 <= i < len(base.layers)]
    if bad:
        raise ValueError(f"Calibration layers {bad} are outside 0..{len(base.layers) - 1}.")
    num_sequences, seq_len = input_ids.shape
    if sequence_groups is not None:
        sequence_groups = torch.as_tensor(sequence_groups, dtype=torch.long)
        if sequence_groups.shape != (num_sequences,):
            raise ValueError(f"sequence_groups must hold one group id per sequence ({num_sequences}).")
    # Fixed token positions for the hidden-state sample: [n] sorted global indices.
    generator = torch.Generator().manual_seed(seed)
    sample = torch.randperm(num_sequences * seq_len, generator=generator)[:max_hidden_samples].sort().values
    return {
        i: _LayerAccumulator(
            i, base.layers[i].mlp, num_groups, token_groups, sequence_groups, with_gradients, sample, seq_len
        )
        for i in layers
    }


def _forward(model, batch: torch.LongTensor, with_gradients: bool) -> None:
    if not with_gradients:
        with torch.no_grad():
            _base_model(model)(input_ids=batch)  # the LM head is not needed
        return
    # Gradients flow from the loss back to every layer's h; a leaf embedding switches autograd on.
    embeds = model.get_input_embeddings()(batch).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
    loss.backward()

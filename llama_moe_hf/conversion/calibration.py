"""Calibration data and statistics for the data-driven expert construction methods.

    load_calibration_texts   local file/folder, a `datasets` name, or the built-in corpus -> list of documents
    tokenize_calibration     documents -> `[B, seq_len]` token ids (packed, EOS between documents)
    collect_calibration      one streaming pass over the dense model -> per-layer `LayerCalibration`

The statistics are bounded in memory whatever the number of calibration tokens: running sums for means and
importances, and a fixed-size deterministic sample of the MLP inputs.
"""

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .corpus import stdlib_docstrings

logger = logging.getLogger(__name__)
DEFAULT_CALIBRATION_SAMPLES = 8192  # MLP inputs kept per layer (`--calibration-samples`)

TEXT_SUFFIXES = (".txt", ".md", ".json", ".jsonl", ".parquet")
# `token_groups(layer_idx, mlp_inputs [T, H]) -> group ids [T]`: buckets the importance of each token.
TokenGroups = Callable[[int, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------------------------------
# Texts
# ----------------------------------------------------------------------------------------------------------------


def _texts_from_records(records: list, source: str, text_column: str | None) -> list[str]:
    """Documents from a list of strings or of dict rows (the `text_column`, else `text`, else the only str field)."""
    texts = []
    for row in records:
        if isinstance(row, str):
            texts.append(row)
            continue
        if not isinstance(row, dict):
            raise ValueError(f"{source}: expected strings or objects with a text field, found {type(row).__name__}.")
        column = text_column or _pick_text_column(row, source)
        if column not in row:
            raise ValueError(f"{source}: a row has no {column!r} field (fields: {sorted(row)}).")
        texts.append(str(row[column]))
    return texts


def _pick_text_column(row: dict, source: str) -> str:
    if "text" in row:
        return "text"
    string_fields = [key for key, value in row.items() if isinstance(value, str)]
    if len(string_fields) != 1:
        raise ValueError(
            f"{source}: cannot tell which field holds the text (fields: {sorted(row)}); "
            "name the text field 'text'."
        )
    return string_fields[0]


def _read_text_file(path: Path, text_column: str | None) -> list[str]:
    """One file -> documents. .txt/.md: the whole file is one document; .json: a list (or {"data": [...]}) of
    strings or rows; .jsonl: one string or row per line; .parquet: the text column of every row."""
    suffix = path.suffix.lower()
    if suffix in (".txt", ".md"):
        return [path.read_text(encoding="utf-8", errors="replace")]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return _texts_from_records(pq.read_table(path).to_pylist(), str(path), text_column)
    try:
        if suffix == ".jsonl":
            lines = path.read_text(encoding="utf-8").splitlines()
            records = [json.loads(line) for line in lines if line.strip()]
        else:
            records = json.loads(path.read_text(encoding="utf-8") or "[]")
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid {suffix[1:].upper()}: {error}") from None
    if isinstance(records, dict):
        lists = [value for value in records.values() if isinstance(value, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: expected a JSON list of documents (or an object holding one list).")
        records = lists[0]
    return _texts_from_records(records, str(path), text_column)


def _load_dataset_texts(
    name: str, text_column: str | None, split: str, max_chars: int | None, dataset_loader: Callable
) -> list[str]:
    """A `datasets` dataset, `NAME` or `NAME:CONFIG`, streamed so only what is needed is read."""
    path, _, config = name.partition(":")
    try:
        dataset = dataset_loader(path, config or None, split=split, streaming=True)
        texts, total = [], 0
        for row in dataset:
            texts.extend(_texts_from_records([row], name, text_column))
            total += len(texts[-1])
            if max_chars is not None and total >= max_chars:
                break
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - datasets raises many types (not found, offline, auth, ...)
        raise ValueError(
            f"Could not load calibration data {name!r}: it is not a local file or folder, and "
            f"datasets.load_dataset({path!r}{', ' + repr(config) if config else ''}, split={split!r}) failed "
            f"({type(error).__name__}: {error}). Pass a local .txt/.json/.jsonl/.parquet file or folder, a dataset "
            "reachable from here, or omit --calibration-data to use the built-in corpus."
        ) from None
    return texts


def load_calibration_texts(
    spec: str | None,
    *,
    text_column: str | None = None,
    split: str = "train",
    max_chars: int | None = None,
    dataset_loader: Callable | None = None,
) -> tuple[list[str], str]:
    """Calibration documents and a one-line description of where they came from (for the log).

    `spec` is None (the built-in corpus: Python standard-library docstrings, no download), a local .txt/.md/.json/
    .jsonl/.parquet file, a folder (its files with those suffixes, recursively, in sorted order), or a
    `datasets` name (`NAME` or `NAME:CONFIG`; needs the Hub or a local datasets cache). `max_chars` stops reading a
    streamed dataset early. `dataset_loader` defaults to `datasets.load_dataset` (the seam tests replace).
    """
    if spec is None:
        texts = stdlib_docstrings()
        return texts, f"built-in corpus: Python stdlib docstrings ({len(texts)} docs)"
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"Calibration folder {path} holds no {'/'.join(TEXT_SUFFIXES)} files.")
        texts = [text for file in files for text in _read_text_file(file, text_column)]
        description = f"local folder {path} ({len(files)} files, {len(texts)} docs)"
    elif path.is_file():
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise ValueError(f"Calibration file {path} must end in one of {', '.join(TEXT_SUFFIXES)}.")
        texts = _read_text_file(path, text_column)
        description = f"local file {path} ({len(texts)} docs)"
    else:
        if dataset_loader is None:
            from datasets import load_dataset as dataset_loader
        texts = _load_dataset_texts(spec, text_column, split, max_chars, dataset_loader)
        description = f"datasets {spec!r} split {split!r} ({len(texts)} docs)"
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise ValueError(f"Calibration data {spec!r} holds no text.")
    return texts, description


def tokenize_calibration(texts: list[str], tokenizer, num_tokens: int, seq_len: int) -> torch.LongTensor:
    """Pack documents into `[num_tokens // seq_len, seq_len]` token ids, EOS between documents, in order.

    Uses the first `num_tokens` tokens (fewer, with a warning, when the texts are shorter); deterministic.
    """
    if seq_len < 2:
        raise ValueError(f"--calibration-seq-len must be at least 2, got {seq_len}.")
    if num_tokens < seq_len:
        raise ValueError(f"--calibration-tokens ({num_tokens}) must be at least one sequence ({seq_len} tokens).")
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + separator)
        if len(stream) >= num_tokens:
            break
    num_sequences = min(num_tokens, len(stream)) // seq_len
    if num_sequences == 0:
        raise ValueError(
            f"The calibration text has only {len(stream)} tokens, fewer than one sequence of {seq_len}; "
            "give more text or a smaller --calibration-seq-len."
        )
    if len(stream) < num_tokens:
        logger.warning(
            "Calibration text has %d tokens, fewer than the %d asked for; using %d sequences of %d.",
            len(stream), num_tokens, num_sequences, seq_len,
        )
    return torch.tensor(stream[: num_sequences * seq_len], dtype=torch.long).view(num_sequences, seq_len)


# ----------------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------------


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


class _LayerAccumulator:
    """Hooks on one dense MLP: `mlp` (inputs) and `mlp.down_proj` (activations h and, in backward, dL/dh)."""

    def __init__(self, layer_idx, mlp, num_groups, token_groups, with_gradients, num_samples):
        self.layer_idx = layer_idx
        self.num_groups = num_groups
        self.token_groups = token_groups
        self.with_gradients = with_gradients
        self.hidden_size = mlp.down_proj.out_features
        self.sample_rows: torch.Tensor | None = None  # rows of the current batch to keep, set per batch
        # Filled in place, batch by batch: appending pieces and concatenating them at the end would leave the freed
        # pieces in the allocator's heap and about double the resident memory (measured: 11.9 GB for 30 x 65536).
        self.samples = torch.empty(num_samples, self.hidden_size)
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

    def _mlp_input(self, module, args):
        x = args[0].detach().flatten(0, -2)  # [T, H]
        if self.sample_rows is not None and self.sample_rows.numel():
            end = self.num_sampled + self.sample_rows.numel()
            self.samples[self.num_sampled : end] = x[self.sample_rows.to(x.device)].float().cpu()
            self.num_sampled = end
        if self.with_gradients:
            if self.token_groups is None:
                self.groups = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
            else:
                with torch.no_grad():
                    self.groups = self.token_groups(self.layer_idx, x).to(device=x.device, dtype=torch.long)
                groups = self.groups
                valid = groups.shape == (x.shape[0],) and bool(((groups >= 0) & (groups < self.num_groups)).all())
                if not valid:
                    raise ValueError(f"token_groups must return {x.shape[0]} group ids in [0, {self.num_groups}).")

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


def _base_model(model):
    return getattr(model, model.base_model_prefix, model)


def collect_calibration(
    model,
    input_ids: torch.LongTensor,  # [B, S]
    layers,
    *,
    with_gradients: bool = False,
    token_groups: TokenGroups | None = None,
    sequence_groups: torch.Tensor | None = None,
    num_groups: int = 1,
    max_hidden_samples: int = DEFAULT_CALIBRATION_SAMPLES,
    batch_size: int = 4,
    device: torch.device | str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[int, LayerCalibration]:
    """Stream the calibration sequences through a dense LLaMA model and return statistics for the `layers`' MLPs.

    With `with_gradients`, the summed next-token loss is back-propagated (the parameters get no gradients) and each
    token's |h * dL/dh| is added to its group: `token_groups(layer_idx, mlp_inputs [T, H]) -> [T]` (for example the
    argmax of a router), or `sequence_groups [B]` (one group per calibration sequence), else group 0. A summed loss
    makes the statistics independent of `batch_size`. The hidden-state sample takes the same token positions
    (seeded) whatever the batch size. Runs on `device` (the model is moved there), else on the model's device.
    """
    if token_groups is not None and sequence_groups is not None:
        raise ValueError("Pass token_groups or sequence_groups, not both.")
    if device is not None:
        model.to(device)
    device = next(model.parameters()).device
    layers = sorted(set(layers))
    decoder_layers = _base_model(model).layers
    bad = [i for i in layers if not 0 <= i < len(decoder_layers)]
    if bad:
        raise ValueError(f"Calibration layers {bad} are outside 0..{len(decoder_layers) - 1}.")
    num_sequences, seq_len = input_ids.shape
    total_tokens = num_sequences * seq_len
    if sequence_groups is not None:
        sequence_groups = torch.as_tensor(sequence_groups, dtype=torch.long)
        if sequence_groups.shape != (num_sequences,):
            raise ValueError(f"sequence_groups must hold one group id per sequence ({num_sequences}).")
    # Fixed token positions for the hidden-state sample: [n] sorted global indices.
    generator = torch.Generator().manual_seed(seed)
    sample = torch.randperm(total_tokens, generator=generator)[:max_hidden_samples].sort().values

    accumulators = {
        i: _LayerAccumulator(i, decoder_layers[i].mlp, num_groups, token_groups, with_gradients, sample.numel())
        for i in layers
    }
    was_training = model.training
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    model.eval()
    model.requires_grad_(False)
    try:
        for start in tqdm(range(0, num_sequences, batch_size), desc="Calibrating", unit="batch", disable=not progress):
            batch = input_ids[start : start + batch_size].to(device)
            first, last = start * seq_len, (start + batch.shape[0]) * seq_len
            in_batch = sample[(sample >= first) & (sample < last)] - first
            for acc in accumulators.values():
                acc.sample_rows = in_batch
                if sequence_groups is not None:
                    groups = sequence_groups[start : start + batch.shape[0]].repeat_interleave(seq_len)
                    acc.token_groups = lambda layer_idx, x, groups=groups: groups
            if with_gradients:
                # Gradients flow from the loss back to every layer's h; a leaf embedding switches autograd on.
                embeds = model.get_input_embeddings()(batch).detach().requires_grad_(True)
                logits = model(inputs_embeds=embeds).logits
                loss = F.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
                )
                loss.backward()
                del logits, loss, embeds
            else:
                with torch.no_grad():
                    _base_model(model)(input_ids=batch)  # the LM head is not needed
    finally:
        for acc in accumulators.values():
            acc.remove()
        for name, param in model.named_parameters():
            param.requires_grad_(requires_grad[name])
        model.train(was_training)
    return {i: acc.result() for i, acc in accumulators.items()}


def sequence_embeddings(
    model, input_ids: torch.LongTensor, batch_size: int = 4, progress: bool = True
) -> torch.Tensor:
    """`[B, H]` float32 CPU: each calibration sequence's mean final hidden state (used to cluster the texts)."""
    device = next(model.parameters()).device
    base = _base_model(model)
    outputs = []
    with torch.no_grad():
        batches = range(0, input_ids.shape[0], batch_size)
        for start in tqdm(batches, desc="Embedding texts", unit="batch", disable=not progress):
            hidden = base(input_ids=input_ids[start : start + batch_size].to(device)).last_hidden_state
            outputs.append(hidden.float().mean(dim=1).cpu())
    return torch.cat(outputs)

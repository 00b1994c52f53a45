"""The dense model run a decoder layer at a time: one layer's weights are in memory at once, beside the sequences'
states (`DecoderLayers`; calibration's statistics run on it, `statistics.collect_calibration`), and the hidden states
at the input of each layer (`layer_input_states`: the `hidden` and `expert_data` router inits of a merge).

    h_0 = embed(tokens);  h_{i+1} = layer_i(h_i)    the source family's own decoder layer, rotary embedding and
                                                      causal / sliding-window masks, in float32

so `h_i` is transformers' `output_hidden_states[i]` of the whole model, for every i below `num_hidden_layers`.
"""

import functools
import inspect

import torch

from ..devices import default_device

REDUCTIONS = ("last", "mean", "sum")  # what stands for a sequence: its last token's state, their mean or sum
BATCH = 16  # sequences of one length run through a layer together


@torch.no_grad()
def layer_input_states(source, token_lists, reduce: str = "last", device=None, progress: bool = False) -> torch.Tensor:
    """`[L, P, H]` float32 on the CPU: for each of the `L` decoder layers' inputs and each of the `P` token sequences
    (1-D ids, each whole and causal: no padding), its states reduced over the sequence (`REDUCTIONS`).

    source: a `DenseSource` (its `config`, `family`, `tensor`, `layer_names`). device: where the layers run (None:
    CUDA when available, else CPU)."""
    from tqdm.auto import tqdm

    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {', '.join(REDUCTIONS)}, not {reduce!r}.")
    runner = SourceLayers(source, torch.device(device or default_device()))
    groups = _by_length(token_lists)
    states = {
        length: runner.embed([list(token_lists[i]) for i in rows]).to(runner.device) for length, rows in groups.items()
    }
    layers = runner.config.num_hidden_layers
    reduced = torch.empty(layers, len(token_lists), runner.config.hidden_size)
    for layer_idx in tqdm(range(layers), desc="Hidden states", unit="layer", disable=not progress):
        for length, rows in groups.items():
            reduced[layer_idx, rows] = _reduce(states[length], reduce).cpu()
        if layer_idx + 1 < layers:  # the last layer's output is no layer's input
            layer = runner.layer(layer_idx)
            states = {length: runner.run(layer, layer_idx, s) for length, s in states.items()}
    return reduced


class DecoderLayers:
    """The dense model's decoder layers, run one at a time as the whole model runs them, on `device`.

    From a `DenseSource` (`SourceLayers`: each layer's weights read when it runs, so one is in memory at a time) or
    from a model already loaded (`ModelLayers`: its own modules). The states between layers stay where the caller
    keeps them (the CPU); each batch is moved to `device` for the layer and back.
    """

    config = None
    model = None  # the loaded model whose layers these are (`ModelLayers`)
    device: torch.device
    dtype = torch.float32  # what the layers compute in

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[B, S, H]` float32 input embeddings, on the CPU."""
        raise NotImplementedError

    def layer(self, layer_idx: int):
        raise NotImplementedError

    def release(self, layer) -> None:
        """Done with `layer` (a source's layer is dropped, a loaded model's kept)."""

    def final_norm(self) -> torch.nn.Module:
        raise NotImplementedError

    def lm_head_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def _setup(self, config, rotary, layer_types, device):
        self.config, self.rotary, self.layer_types, self.device = config, rotary, layer_types, device

    def run(self, layer, layer_idx: int, states: torch.Tensor, batch_size: int = BATCH, before_batch=None):
        """The layer's output on `[B, S, H]` states (returned where the states are), `batch_size` sequences at a
        time; `before_batch(first_sequence, num_sequences)` is called before each batch runs."""
        outputs = []
        for start, batch in zip(range(0, states.shape[0], batch_size), states.split(batch_size)):
            if before_batch is not None:
                before_batch(start, batch.shape[0])
            outputs.append(
                self.call(layer, layer_idx, batch.to(self.device, self.dtype)).to(states.device, states.dtype)
            )
        return torch.cat(outputs)

    def call(self, layer, layer_idx: int, batch: torch.Tensor) -> torch.Tensor:
        """The layer on one `[b, S, H]` batch already on the device (causal or sliding-window mask, no padding)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        sliding = self.layer_types[layer_idx] == "sliding_attention"
        make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
        positions = torch.arange(batch.shape[1], device=self.device)[None]
        rotary = self.rotary(batch[:1], positions)
        mask = make_mask(
            config=self.config, inputs_embeds=batch, attention_mask=None, position_ids=positions, **_no_cache()
        )
        return layer(batch, attention_mask=mask, position_ids=positions, position_embeddings=rotary)


class SourceLayers(DecoderLayers):
    """A `DenseSource`'s layers, each read from the checkpoint when it runs, in float32 (`config._attn_implementation`:
    sdpa; the sequences carry no padding)."""

    def __init__(self, source, device: torch.device):
        config = type(source.config).from_dict(source.config.to_dict())  # the source's own config stays untouched
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = source.family.model_class()(config)
        self.source = source
        self.layer_class, self.norm_class = type(model.model.layers[0]), type(model.model.norm)
        device = torch.device(device)
        self._setup(
            config, type(model.model.rotary_emb)(config=config).to(device), source.family.layer_types(config), device
        )

    def embed(self, input_ids) -> torch.Tensor:
        """Looked up in the stored dtype (the matrix is never copied whole)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        return torch.nn.functional.embedding(ids, self.source.tensor("model.embed_tokens.weight")).float()

    def layer(self, layer_idx: int):
        prefix = f"model.layers.{layer_idx}."
        weights = {
            name[len(prefix) :]: self.source.tensor(name).to(self.device, torch.float32)
            for name in self.source.layer_names(layer_idx)
        }
        with torch.device("meta"):
            layer = self.layer_class(self.config, layer_idx)
        layer.load_state_dict(weights, assign=True)
        return layer.eval().requires_grad_(False)

    def final_norm(self):
        with torch.device("meta"):
            norm = self.norm_class(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.load_state_dict(
            {"weight": self.source.tensor("model.norm.weight").to(self.device, torch.float32)}, assign=True
        )
        return norm.requires_grad_(False)

    def lm_head_weight(self):
        name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return self.source.tensor(name).to(self.device, torch.float32)


class ModelLayers(DecoderLayers):
    """A loaded model's own layers, on its device (callers keep it in eval mode without parameter gradients)."""

    def __init__(self, model):
        base = getattr(model, model.base_model_prefix, model)
        self.model, self.base = model, base
        from ..source_families.base import SOURCE_FAMILIES

        layer_types = SOURCE_FAMILIES[model.config.model_type]().layer_types(model.config)
        parameter = next(model.parameters())
        self.dtype = parameter.dtype
        self._setup(model.config, base.rotary_emb, layer_types, parameter.device)

    def embed(self, input_ids) -> torch.Tensor:
        with torch.no_grad():
            return self.base.embed_tokens(torch.as_tensor(input_ids).to(self.device)).float().cpu()

    def layer(self, layer_idx: int):
        return self.base.layers[layer_idx]

    def final_norm(self):
        return self.base.norm

    def lm_head_weight(self):
        return self.model.get_output_embeddings().weight


@functools.cache
def _no_cache() -> dict:
    """The masks' no-cache argument: named `cache` from transformers 5.24, `past_key_values` before."""
    from transformers.masking_utils import create_causal_mask

    return {"cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values": None}


def decoder_layers(model, device=None) -> DecoderLayers:
    """A `DenseSource`'s layers (on `device`, else CUDA when available), or a loaded model's (moved to `device` when
    given)."""
    if hasattr(model, "layer_names"):
        return SourceLayers(model, torch.device(device or default_device()))
    if device is not None:
        model.to(device)
    return ModelLayers(model)


def _by_length(token_lists) -> dict[int, list[int]]:
    """The sequences' indices grouped by length (one batch each; no padding)."""
    groups: dict[int, list[int]] = {}
    for index, tokens in enumerate(token_lists):
        if len(tokens) == 0:
            raise ValueError("A sequence of the hidden-state pass has no tokens.")
        groups.setdefault(len(tokens), []).append(index)
    return groups


def _reduce(states: torch.Tensor, reduce: str) -> torch.Tensor:
    if reduce == "last":
        return states[:, -1]
    return states.mean(dim=1) if reduce == "mean" else states.sum(dim=1)

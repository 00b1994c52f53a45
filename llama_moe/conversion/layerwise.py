"""The dense model's hidden states at the input of each decoder layer, computed a layer at a time (the `hidden` and
`expert_data` router inits of a merge): one layer's weights are in memory at once, beside the sequences' states.

    h_0 = embed(tokens);  h_{i+1} = layer_i(h_i)    the source family's own decoder layer, rotary embedding and
                                                      causal / sliding-window masks, in float32

so `h_i` is transformers' `output_hidden_states[i]` of the whole model, for every i below `num_hidden_layers`.
"""

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
    runner = _LayerRunner(source, torch.device(device or default_device()))
    groups = _by_length(token_lists)
    states = {length: runner.embed([token_lists[i] for i in rows]) for length, rows in groups.items()}
    layers = runner.config.num_hidden_layers
    reduced = torch.empty(layers, len(token_lists), runner.config.hidden_size)
    for layer_idx in tqdm(range(layers), desc="Hidden states", unit="layer", disable=not progress):
        for length, rows in groups.items():
            reduced[layer_idx, rows] = _reduce(states[length], reduce).cpu()
        if layer_idx + 1 < layers:  # the last layer's output is no layer's input
            layer = runner.layer(layer_idx)
            states = {length: runner.run(layer, layer_idx, s) for length, s in states.items()}
    return reduced


class _LayerRunner:
    """One decoder layer of the source at a time, run as the whole model runs it (`config._attn_implementation`:
    sdpa; the sequences carry no padding)."""

    def __init__(self, source, device: torch.device):
        config = type(source.config).from_dict(source.config.to_dict())  # the source's own config stays untouched
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = source.family.model_class()(config)
        self.source, self.config, self.device = source, config, device
        self.layer_class = type(model.model.layers[0])
        self.rotary = type(model.model.rotary_emb)(config=config).to(device)
        self.layer_types = source.family.layer_types(config)

    def embed(self, token_lists) -> torch.Tensor:
        """`[B, S, H]` input embeddings, looked up in the stored dtype (the matrix is never copied whole)."""
        ids = torch.as_tensor([list(tokens) for tokens in token_lists], dtype=torch.long)
        weight = self.source.tensor("model.embed_tokens.weight")
        return torch.nn.functional.embedding(ids, weight).to(self.device, torch.float32)

    def layer(self, layer_idx: int):
        prefix = f"model.layers.{layer_idx}."
        weights = {
            name[len(prefix) :]: self.source.tensor(name).to(self.device, torch.float32)
            for name in self.source.layer_names(layer_idx)
        }
        with torch.device("meta"):
            layer = self.layer_class(self.config, layer_idx)
        layer.load_state_dict(weights, assign=True)
        return layer.eval()

    def run(self, layer, layer_idx: int, states: torch.Tensor) -> torch.Tensor:
        """The layer's output on `[B, S, H]` states, `BATCH` sequences at a time."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        sliding = self.layer_types[layer_idx] == "sliding_attention"
        make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
        positions = torch.arange(states.shape[1], device=self.device)[None]
        rotary = self.rotary(states[:1], positions)
        outputs = []
        for batch in states.split(BATCH):
            mask = make_mask(
                config=self.config, inputs_embeds=batch, attention_mask=None, cache=None, position_ids=positions
            )
            outputs.append(layer(batch, attention_mask=mask, position_ids=positions, position_embeddings=rotary))
        return torch.cat(outputs)


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

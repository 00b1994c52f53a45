"""Domain mixtures for continual pre-training (LLaMA-MoE v1): packed blocks per domain, sampled by domain weights.

DomainData          one domain's packed training blocks [N, L] and held-out blocks [M, L]
DomainWeights       the current sampling weights (static, or updated in place by dynamic sampling)
DomainMixture       an endless iterable of {"input_ids", "labels"} blocks, each drawn from a domain picked by
                    the current weights; counts what it drew
sheared_llama_update  Sheared-LLaMA's dynamic batch loading step (excess loss over a reference, exponentiated,
                    smoothed)
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset

# LLaMA's pre-training mixture (Touvron et al., 2023), in SlimPajama's domain names as the LLaMA-MoE code base uses
# them: LLaMA-MoE's static baseline. The domains of a preset must match the recipe's `domains` by name.
PRESET_WEIGHTS = {
    "llama": {
        "en_cc": 0.67,
        "en_c4": 0.15,
        "github": 0.045,
        "en_wikipedia": 0.045,
        "en_book": 0.045,
        "en_arxiv": 0.025,
        "en_stack": 0.02,
    },
}
# LLaMA-2-7B's validation loss per SlimPajama domain (from the LLaMA-MoE code base): the reference losses of
# LLaMA-MoE's dynamic sampling, i.e. the dense model the MoE is recovering towards.
PRESET_REFERENCE_LOSSES = {
    "llama2-7b-slimpajama": {
        "en_book": 1.9252,
        "en_wikipedia": 1.5899,
        "en_stack": 1.4975,
        "github": 0.6984,
        "en_c4": 2.0749,
        "en_cc": 1.6917,
        "en_arxiv": 1.2408,
    },
}


def parse_pairs(specs: list[str] | None, what: str, cast=str) -> dict:
    """["NAME=VALUE", ...] -> {NAME: cast(VALUE)}, with one clear error for a malformed item."""
    pairs = {}
    for spec in specs or []:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{what} must be given as NAME=VALUE, got {spec!r}.")
        try:
            pairs[name] = cast(value)
        except ValueError:
            raise ValueError(f"{what} {name!r}: {value!r} is not a {cast.__name__}.") from None
    return pairs


def named_values(spec: list[str] | str, presets: dict[str, dict[str, float]], what: str) -> dict[str, float]:
    """A preset's values (`spec` its name, alone or as the only list item) or "NAME=VALUE" items."""
    if isinstance(spec, list) and len(spec) == 1 and "=" not in spec[0]:
        spec = spec[0]
    if isinstance(spec, list):
        return parse_pairs(spec, what, float)
    if spec not in presets:
        raise ValueError(f"Unknown {what.lower()} preset {spec!r}; choose {', '.join(presets)}.")
    return presets[spec]


def resolve_weights(spec: list[str] | str | None, domains: list[str]) -> np.ndarray:
    """Sampling weights in `domains` order from a preset name, "NAME=W" items, or None / "uniform"; normalised."""
    if spec is None or spec in ("uniform", ["uniform"]):
        return np.full(len(domains), 1 / len(domains))
    given = named_values(spec, PRESET_WEIGHTS, "Domain weights")
    missing, extra = sorted(set(domains) - set(given)), sorted(set(given) - set(domains))
    if missing or extra:
        raise ValueError(f"Domain weights must name exactly the domains {domains}: missing {missing}, unknown {extra}.")
    weights = np.array([given[name] for name in domains], dtype=np.float64)
    if (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"Domain weights must be >= 0 with a positive sum, got {given}.")
    return weights / weights.sum()


@dataclass
class DomainData:
    name: str
    train: torch.Tensor  # [N, L] token blocks
    held_out: torch.Tensor  # [M, L] token blocks from documents not in `train`


def load_domain(
    name: str, path: str, tokenizer, seq_len: int, held_out_fraction: float, held_out_path=None, text_column=None
) -> DomainData:
    """A domain's documents (any source `llama-moe convert --calibration-data` reads). The held-out blocks come from
    `held_out_path` when given, else from a seeded `held_out_fraction` of the documents (whole documents)."""
    from ..text.documents import load_texts
    from ..text.tokens import pack_blocks

    texts, _ = load_texts(path, text_column=text_column, what=f"Domain {name!r}")
    if held_out_path is not None:
        held_texts, _ = load_texts(held_out_path, text_column=text_column, what=f"Held-out {name!r}")
    else:
        order = np.random.default_rng(0).permutation(len(texts))
        n_held = max(1, round(held_out_fraction * len(texts)))
        held_texts, texts = [texts[i] for i in order[:n_held]], [texts[i] for i in order[n_held:]]
    held_out = pack_blocks(held_texts, tokenizer, seq_len)
    train = pack_blocks(texts, tokenizer, seq_len)
    if len(train) == 0 or len(held_out) == 0:
        raise ValueError(f"Domain {name!r} ({path}) has too little text for {seq_len}-token blocks.")
    return DomainData(name, train, held_out)


class DomainWeights:
    """The sampling weights of the domains, shared by the data stream and the callback that updates them."""

    def __init__(self, names: list[str], weights: np.ndarray):
        self.names = list(names)
        self.values = np.asarray(weights, dtype=np.float64)

    def as_dict(self) -> dict[str, float]:
        return {name: float(value) for name, value in zip(self.names, self.values)}


def sheared_llama_update(
    weights: np.ndarray, losses: np.ndarray, reference: np.ndarray, step_size: float = 1.0, smoothing: float = 1e-4
) -> np.ndarray:
    """Dynamic batch loading (Sheared-LLaMA, arXiv:2310.06694, Alg. 1): excess loss `max(loss - reference, 0)`,
    `w <- softmax(log w + step_size * excess)`, then smoothed towards uniform: `(1 - c) w + c / K`."""
    excess = np.maximum(np.asarray(losses) - np.asarray(reference), 0.0)
    logits = np.log(weights) + step_size * excess
    updated = np.exp(logits - logits.max())
    updated /= updated.sum()
    return (1 - smoothing) * updated + smoothing / len(updated)


class DomainMixture(IterableDataset):
    """Endless stream of training blocks: each block's domain is drawn from `weights` (read at every draw, so dynamic
    updates apply at once), each domain's blocks are visited in a seeded random order, reshuffled per pass.

    The stream is a function of the seed and of the weights in force at each draw, which `schedule` records as
    (first draw, weights) whenever they change. A resumed run loads the schedule and the draw count of the saved
    state (`load_state_dict`) and draws those blocks again with the weights they had, so skipping the trained batches
    puts it exactly where it was; the weights as they were at the save apply from the next draw on."""

    def __init__(self, domains: list[DomainData], weights: DomainWeights, seed: int = 0):
        self.domains = domains
        self.weights = weights
        self.seed = seed
        self.drawn = np.zeros(len(domains), dtype=np.int64)  # blocks drawn per domain so far
        self.schedule: list[tuple[int, list[float]]] = [(0, weights.values.tolist())]
        self.replay_until = 0  # draws of a resumed run that take their weights from the schedule

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "names": self.weights.names,
            "schedule": self.schedule,
            "draws": int(self.drawn.sum()),
            "weights": self.weights.values.tolist(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["names"] != self.weights.names or state["seed"] != self.seed:
            raise ValueError(
                f"The checkpoint's domain mixture ({state['names']}, seed {state['seed']}) is not this run's "
                f"({self.weights.names}, seed {self.seed}): resume with the same domains and seed."
            )
        self.schedule = [(int(start), list(values)) for start, values in state["schedule"]]
        self.replay_until = int(state["draws"])
        self.weights.values = np.array(state["weights"], dtype=np.float64)

    def _probabilities(self, draw: int) -> np.ndarray:
        """The weights of draw number `draw`: recorded ones while replaying, else the current (recorded on change)."""
        if draw < self.replay_until:
            return np.array(next(v for s, v in reversed(self.schedule) if s <= draw), dtype=np.float64)
        if self.schedule[-1][1] != self.weights.values.tolist():
            self.schedule.append((draw, self.weights.values.tolist()))
        return self.weights.values

    def __iter__(self):
        # A new pass (the Trainer rebuilt its dataloader) starts the stream over: its first draws replay the weights
        # recorded for them, and the counts start again.
        self.replay_until = max(self.replay_until, int(self.drawn.sum()))
        self.drawn[:] = 0
        rng = np.random.default_rng(self.seed)
        orders = [rng.permutation(len(domain.train)) for domain in self.domains]
        positions = [0] * len(self.domains)
        draw = 0
        while True:
            index = int(rng.choice(len(self.domains), p=self._probabilities(draw)))
            if positions[index] == len(orders[index]):  # a pass over this domain is done: reshuffle
                orders[index], positions[index] = rng.permutation(len(orders[index])), 0
            block = self.domains[index].train[orders[index][positions[index]]]
            positions[index] += 1
            self.drawn[index] += 1
            draw += 1
            yield {"input_ids": block, "labels": block}

"""Calibration: the context that runs the dense model once for every component of a conversion.

tokenize_calibration documents -> `[B, seq_len]` calibration token ids (`text.tokens`, with the checks of the flags)
CalibrationContext   one per conversion: reads the calibration text (`text`), loads the dense model at most once,
                     records every statistic the components asked for in one pass, and hands the results to them
"""

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..devices import default_device
from ..text.documents import load_texts, refuse_missing_file
from ..text.tokens import cut_blocks, token_stream
from .routers.fit.attention_fit import AttentionCalibration
from .statistics import CalibrationStatistics, LayerCalibration, collect_calibration

logger = logging.getLogger(__name__)

# Made by the dense model itself (`text.chat`), not read from a file: (what, what goes in turn with it)
SELF_MADE = {
    "builtin:chat": ("chat", None),
    "builtin:chat-mixed": ("chat", "mixed"),
    "builtin:chat-self": ("chat", "self"),
    "builtin:self": ("self", None),
}


def text_tokens(recipe) -> int:
    """The tokens a conversion reads of its calibration text: the heals' together, or the calibration's where more
    (what the dense model writes of `SELF_MADE` text before it is released, and what the forecast counts)."""
    return max(recipe.heal_tokens + recipe.joint_heal_tokens, recipe.calibration_tokens)


def conversation_tokens(num_tokens: int) -> int:
    """The conversations' tokens in `num_tokens` of a mix (`builtin:chat-mixed`): about half (a margin: never short)."""
    return num_tokens * 3 // 5


@contextlib.contextmanager
def transformers_progress_bars(enabled: bool):
    """transformers' own bars (its "Loading weights") shown or not, as ours are; the global switch is restored."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def tokenize_calibration(texts: list[str], tokenizer, num_tokens: int, seq_len: int) -> torch.LongTensor:
    """Pack documents into `[num_tokens // seq_len, seq_len]` token ids, EOS between documents, in order.

    Uses the first `num_tokens` tokens (fewer, with a warning, when the texts are shorter); deterministic.
    """
    if seq_len < 2:
        raise ValueError(f"--calibration-seq-len must be at least 2, got {seq_len}.")
    if num_tokens < seq_len:
        raise ValueError(f"--calibration-tokens ({num_tokens}) must be at least one sequence ({seq_len} tokens).")
    stream = token_stream(texts, tokenizer, num_tokens)
    blocks = cut_blocks(stream, seq_len)
    if len(blocks) == 0:
        raise ValueError(
            f"The calibration text has only {len(stream)} tokens, fewer than one sequence of {seq_len}; "
            "give more text or a smaller --calibration-seq-len."
        )
    if len(stream) < num_tokens:
        logger.warning(
            "Calibration text has %d tokens, fewer than the %d asked for; using %d sequences of %d.",
            len(stream),
            num_tokens,
            len(blocks),
            seq_len,
        )
    return blocks


# ----------------------------------------------------------------------------------------------------------------
# The context of one conversion
# ----------------------------------------------------------------------------------------------------------------


def data_path(recipe) -> str | None:
    """The recipe's calibration data, a local file or folder as its full path (a recipe is portable that way); a local
    file that is not there is refused here, before anything is loaded, whether or not the method reads the data."""
    data = recipe.calibration_data
    if data is not None:
        refuse_missing_file(data, "Calibration data")  # `builtin:NAME` names no file: never refused
    if data is not None and Path(data).expanduser().exists():
        return str(Path(data).expanduser().resolve())
    return data


class CalibrationContext:
    """What one conversion learns from running the dense model: computed once, passed explicitly to the components.

    Components first `request_*` the statistics they will use; `collect()` then records them all in a single
    no-gradient pass over the calibration tokens. Gradient passes (neuron importance) and k-means centroids are
    computed on demand and cached. Every pass runs a decoder layer at a time (`statistics.collect_calibration`): from
    `source`, a `DenseSource`, one layer is read and in memory at once; without one, the model `load_model` gives
    runs layer by layer. The whole model is loaded only to make text (`builtin:chat`), and dropped once all the text
    the conversion reads is made. `release()` drops it before the streaming write.

    recipe: the calibration settings (`calibration_*`, `seed`). load_model / load_tokenizer: called at most once.
    input_ids: calibration tokens `[B, S]` to use instead of tokenizing the recipe's calibration data. offload_dir:
    where a gradient pass keeps the layers' inputs when they do not fit in memory (default: a temporary folder).
    """

    def __init__(
        self,
        recipe,
        load_model: Callable,
        load_tokenizer: Callable | None = None,
        *,
        input_ids=None,
        device: str | None = None,
        batch_size: int = 4,
        progress: bool = True,
        source=None,
        offload_dir: str | None = None,
    ):
        self.recipe, self.source, self.offload_dir = recipe, source, offload_dir
        self._load_model, self._load_tokenizer = load_model, load_tokenizer
        self._model = None
        self._released = False
        self._input_ids = input_ids
        self.data_description = "given token ids" if input_ids is not None else None
        self.device, self.batch_size, self.progress = device, batch_size, progress
        self.statistics = CalibrationStatistics()
        self._mlp_requests: set[int] = set()
        self._attention_requests: set[tuple[int, int]] = set()  # (layer, attention experts)
        self._attention: dict[tuple[int, int], AttentionCalibration] = {}
        self._embeddings_requested = False
        self._importance: dict[str, dict[int, LayerCalibration]] = {}
        self._centroids: dict[tuple[int, int], torch.Tensor] = {}  # (layer, experts) -> [E, H]
        self._made: dict = {}  # kind -> `text.chat.SelfMade`, for the data the dense model makes (`SELF_MADE`)
        self._text_made = False  # all of it made, as much as the conversion reads
        self.text_seconds = 0.0  # spent making it (the dense model loaded and generating), a stage of its own

    def serves(self, recipe) -> bool:
        """Whether this context's statistics are those `recipe`'s calibration settings give (to share it)."""
        fields = ("calibration_tokens", "calibration_seq_len", "calibration_samples", "seed")
        same_data = self.data_description == "given token ids" or data_path(self.recipe) == data_path(recipe)
        return same_data and all(getattr(self.recipe, f) == getattr(recipe, f) for f in fields)

    # Requests, then one pass ---------------------------------------------------------------------------------

    def request_mlp(self, layers) -> None:
        """MLP input samples and mean activations of `layers` (`mlp(layer)`)."""
        self._mlp_requests.update(layers)

    def request_attention(self, layers, num_experts: int) -> None:
        """The attention-router fit statistics of `layers` for `num_experts` attention experts (`attention(layer)`)."""
        self._attention_requests.update((layer, num_experts) for layer in layers)

    def request_sequence_embeddings(self) -> None:
        self._embeddings_requested = True

    @property
    def requested(self) -> bool:
        """Whether statistics were asked for: `collect` runs a calibration pass over the dense model."""
        return bool(self._mlp_requests or self._attention_requests or self._embeddings_requested)

    def collect(self) -> None:
        """Record everything requested and not recorded yet, in one pass (nothing to do: no model is loaded)."""
        stats = self.statistics
        mlp = sorted(self._mlp_requests - stats.mlp.keys())
        attention = {}  # one expert count per layer and pass (more only when builds with other counts share a context)
        for layer, experts in sorted(self._attention_requests - self._attention.keys()):
            attention.setdefault(layer, experts)
        embeddings = self._embeddings_requested and stats.sequence_embeddings is None
        if not (mlp or attention or embeddings):
            return
        new = collect_calibration(
            *self._dense_and_tokens(),
            mlp,
            attention_experts=attention,
            sequence_embeddings=embeddings,
            max_hidden_samples=self.recipe.calibration_samples,
            batch_size=self.batch_size,
            seed=self.recipe.seed,
            progress=self.progress,
        )
        stats.mlp.update(new.mlp)
        self._attention.update({(layer, attention[layer]): value for layer, value in new.attention.items()})
        if embeddings:
            stats.sequence_embeddings = new.sequence_embeddings
        self.collect()  # attention statistics for a second expert count of the same layer, if any

    # Results ---------------------------------------------------------------------------------------------------

    def mlp(self, layer: int) -> LayerCalibration:
        self.request_mlp([layer])
        self.collect()
        return self.statistics.mlp[layer]

    def attention(self, layer: int, num_experts: int) -> AttentionCalibration:
        self.request_attention([layer], num_experts)
        self.collect()
        return self._attention[layer, num_experts]

    def sequence_embeddings(self) -> torch.Tensor:
        self.request_sequence_embeddings()
        self.collect()
        return self.statistics.sequence_embeddings

    def importance(self, key: str, layers, **groups) -> dict[int, LayerCalibration]:
        """Neuron importance per token group (a gradient pass), cached under `key`; `groups` are
        `collect_calibration`'s `token_groups` / `sequence_groups` and `num_groups`."""
        if key not in self._importance:
            self._importance[key] = collect_calibration(
                *self._dense_and_tokens(),
                layers,
                with_gradients=True,
                batch_size=self.batch_size,
                max_hidden_samples=0,
                seed=self.recipe.seed,
                progress=self.progress,
                offload_dir=self.offload_dir,
                **groups,
            ).mlp
        return self._importance[key]

    def kmeans_centroids(self, layer: int, num_experts: int) -> torch.Tensor:
        """`[E, H]` balanced k-means centroids of the layer's MLP input sample (routers of LLaMA-MoE v2), cached."""
        if (layer, num_experts) not in self._centroids:
            from .methods.cluster.clustering import kmeans_router

            samples = self.mlp(layer).hidden_states
            self._centroids[layer, num_experts] = kmeans_router(samples, num_experts, seed=self.recipe.seed)
        return self._centroids[layer, num_experts]

    def set_kmeans_centroids(self, centroids: dict[int, torch.Tensor]) -> None:
        """Centroids read from a split file instead of computed."""
        self._centroids.update({(layer, c.shape[0]): c for layer, c in centroids.items()})

    def has_kmeans_centroids(self, layers, num_experts: int) -> bool:
        return all((layer, num_experts) in self._centroids for layer in layers)

    # The model and the tokens ----------------------------------------------------------------------------------

    def model(self):
        """The dense model, loaded on first use (on `device`, else CUDA when available; float32 on CPU)."""
        if self._released:
            raise RuntimeError("The dense model was released: request calibration statistics before prepare().")
        if self._model is None:
            device = self.device or default_device()
            with transformers_progress_bars(self.progress):
                self._model = self._load_model(torch.float32 if device == "cpu" else None, device)
        return self._model

    def _dense_and_tokens(self) -> tuple:
        """(what the statistics run on: the source, else the loaded model; calibration tokens), the tokens made first:
        bad data or a missing tokenizer fails in seconds, before any weight is read."""
        input_ids = self.input_ids
        if self.source is None:
            return self.model(), input_ids
        self._make_text_and_drop_model()  # a whole model in memory beside the pass would undo its bound
        return self.source, input_ids

    @property
    def input_ids(self) -> torch.LongTensor:
        """`[B, calibration_seq_len]` calibration tokens, made once from the recipe's calibration data."""
        if self._input_ids is None:
            self._input_ids = self._tokenize(self.recipe.calibration_tokens)
        return self._input_ids

    def tokens(self, num_tokens: int) -> torch.LongTensor:
        """The first `num_tokens` calibration tokens as `[B, calibration_seq_len]` (healing may train on more or
        fewer tokens than the statistics use); given token ids are used as they are."""
        seq_len = self.recipe.calibration_seq_len
        if self.data_description == "given token ids" or num_tokens <= self.recipe.calibration_tokens:
            return self.input_ids[: max(1, num_tokens // seq_len)]
        return self._tokenize(num_tokens)

    def _tokenize(self, num_tokens: int) -> torch.LongTensor:
        r = self.recipe
        if self._load_tokenizer is None:
            raise ValueError("Calibration text needs a tokenizer; pass one (or calibration token ids).")
        if r.calibration_data in SELF_MADE:
            start = time.perf_counter()
            texts, self.data_description = self._self_made_texts(num_tokens)
            self.text_seconds += time.perf_counter() - start
        else:
            texts, self.data_description = load_texts(
                r.calibration_data,
                max_chars=16 * num_tokens,  # a streamed dataset stops early
            )
        input_ids = tokenize_calibration(texts, self._load_tokenizer(), num_tokens, r.calibration_seq_len)
        num_sequences, seq_len = input_ids.shape
        logger.info("Calibration data: %s -> %d sequences of %d tokens.", self.data_description, num_sequences, seq_len)
        return input_ids

    @property
    def used(self) -> bool:
        """Whether calibration tokens were used (then `conversion_info` records the calibration settings)."""
        return self._input_ids is not None

    def _self_made_texts(self, num_tokens: int) -> tuple[list[str], str]:
        """What the dense model makes (`text.chat`), made once and extended when more tokens are asked for: its
        answers to the calibration prompts (`builtin:chat`), its own sampled text (`builtin:self`), or conversations
        with a document of `builtin:mixed` or a sampled text after each. A tokenizer without a chat template has no
        conversations: `builtin:self` stands in for `builtin:chat-self`, `builtin:mixed` for the others (logged)."""
        from ..text.chat import in_turn, mixed_documents

        first, second = SELF_MADE[self.recipe.calibration_data]
        if first == "chat" and not self._load_tokenizer().chat_template:
            instead = "builtin:self" if second == "self" else "builtin:mixed"
            logger.warning(
                "The tokenizer has no chat template: calibrating on %s instead of %s.",
                instead,
                self.recipe.calibration_data,
            )
            if second != "self":
                return load_texts("builtin:mixed")
            first, second = "self", None
        made = self._maker(first)
        if second is None:
            return made.texts(num_tokens), made.description()
        conversations = made.texts(conversation_tokens(num_tokens))
        others = mixed_documents() if second == "mixed" else self._maker(second).texts(0, count=len(conversations))
        return in_turn(conversations, others), made.description(second)

    def _maker(self, kind: str):
        if kind not in self._made:
            from ..checkpoints.default import cache_dir
            from ..text.chat import SelfDistilledChats, SelfSampledText

            maker = {"chat": SelfDistilledChats, "self": SelfSampledText}[kind]
            self._made[kind] = maker(self.model(), self._load_tokenizer(), self.progress, cache=cache_dir() / "chat")
        return self._made[kind]

    def drop_statistics(self) -> None:
        """Free what the passes recorded (the MLP input samples are the bulk) once the layers are written: what runs
        after them (the joint stage) reads only the tokens."""
        self.statistics = CalibrationStatistics()
        self._attention.clear()
        self._importance.clear()
        self._centroids.clear()

    def release(self) -> None:
        """Drop the dense model (the statistics stay), so that the streaming write holds about one layer."""
        if not self._released:
            self._make_text_and_drop_model()
        self._released = True

    def _make_text_and_drop_model(self) -> None:
        """Text that only the dense model can make (`builtin:chat`) made now, as much as the conversion will read
        (healing included), then the model dropped."""
        r = self.recipe
        made_here = r.calibration_data in SELF_MADE and self.data_description != "given token ids"
        if made_here and (r.heal_tokens or r.joint_heal_tokens or self.used) and not self._text_made:
            self.tokens(text_tokens(r))
            self._text_made = True
        for made in self._made.values():
            made.model = None
        self._model = None

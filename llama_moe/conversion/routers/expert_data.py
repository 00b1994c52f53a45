"""`expert_data`: each expert model's row is the base model's mean hidden state at each decoder layer's input over the
tokens of that expert's own text (its `data`: a file, folder or dataset), minus the mean of the expert models' rows
(`expert_data_center`), L2-normalised per layer. Centred, because the mean states of different texts share one large
direction: uncentred rows are nearly parallel and the router can barely tell the domains apart
(benchmarks/reports/branch-train-mix.md, "Branch-Train-MiX", measures both)."""

import logging
from dataclasses import dataclass

from ..registry import ROUTER_INITS, option
from .expert_vectors import ExpertVectorRouter

logger = logging.getLogger(__name__)

SEQ_LEN = 256  # tokens per sequence of the hidden-state pass (fewer where the model's positions end sooner)


@dataclass(frozen=True)
class ExpertDataOptions:
    expert_data_center: bool = option(True, "subtract the mean over the expert models from each row before normalising")


@ROUTER_INITS.register("expert_data")
class ExpertDataRouter(ExpertVectorRouter):
    description = (
        "per layer, the base model's mean input state over each expert's own data (gate_tokens tokens), centred over "
        "the experts, normalised (llama-moe merge)"
    )
    Options = ExpertDataOptions

    @classmethod
    def check_experts(cls, experts) -> None:
        from ...text.documents import refuse_missing_file

        for expert in experts:
            name, data = expert.describe(), expert.data
            if not data:
                raise ValueError(
                    f"Expert {name} has no data: the {cls.name} gate starts each expert's router row from its own "
                    "text (data: a file, folder or dataset name)."
                )
            refuse_missing_file(data, f"Expert {name}'s data")

    def model_vectors(self, inputs, context):
        """`[L, models, H]`: the sum of the states over every expert's tokens (one pass for all) over their count."""
        import torch

        from ..layerwise import layer_input_states

        tokenizer = inputs.load_tokenizer()
        positions = getattr(inputs.source.config, "max_position_embeddings", None) or SEQ_LEN
        streams = [self._tokens(expert, tokenizer, inputs.gate_tokens) for expert in inputs.experts]
        sequences = [list(stream.split(min(SEQ_LEN, positions))) for stream in streams]
        flat = [sequence for pieces in sequences for sequence in pieces]
        device = inputs.device or context.device
        sums = layer_input_states(inputs.source, flat, "sum", device, progress=context.progress)
        vectors, start = [], 0
        for pieces, stream in zip(sequences, streams, strict=True):
            vectors.append(sums[:, start : start + len(pieces)].sum(dim=1) / len(stream))
            start += len(pieces)
        vectors = torch.stack(vectors, dim=1)
        if self.centred and len(inputs.experts) > 1:  # one model's row has nothing to be centred against
            vectors = vectors - vectors.mean(dim=1, keepdim=True)
        return vectors

    @property
    def centred(self) -> bool:
        # `trained` (a subclass with options of its own) always starts from centred rows
        return getattr(self.options, "expert_data_center", True)

    def _tokens(self, expert, tokenizer, count: int):
        """The first `count` tokens of the expert's data (documents joined by EOS), `[N]`."""
        from ...text.documents import iter_documents
        from ...text.tokens import token_stream

        name = expert.describe()
        stream = token_stream(iter_documents(expert.data, what=f"Expert {name}'s data"), tokenizer, count)
        if len(stream) == 0:
            raise ValueError(f"Expert {name}'s data {expert.data} holds no text.")
        if len(stream) < count:
            logger.warning("Expert %s's data has %d tokens, fewer than gate_tokens (%d).", name, len(stream), count)
        return stream

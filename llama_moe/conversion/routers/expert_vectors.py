"""What the merge's router inits that give each expert model one vector per layer share (`hidden`, `cheap_embed`,
`expert_data`): the vectors L2-normalised per layer, a warning when they are nearly linearly dependent (mergekit's
`warn_degenerate_gates`), each model's vector on its `experts_per_model` consecutive router rows. Registers nothing."""

import logging

from ..target import MLP
from .base import RouterInit, expert_inputs

logger = logging.getLogger(__name__)

DEGENERATE_CONDITION = 5.0  # mergekit's threshold on the condition number of a layer's [models, hidden] vectors


class ExpertVectorRouter(RouterInit):
    """Subclasses compute `model_vectors(inputs, context)`: `[L, models, H]`, one vector per expert model and layer."""

    targets = (MLP,)
    needs_expert_inputs = True

    needs_prompts = False  # every expert model needs positive prompts
    centred = False  # `model_vectors` subtracts the mean over the expert models

    def request(self, context) -> None:
        self.inputs = expert_inputs(context, self)
        self.check_experts(self.inputs.experts)

    def prepare(self, context) -> None:
        vectors = self.model_vectors(self.inputs, context)
        self.vectors = normalized(vectors)
        # Centred rows sum to zero, so they are dependent by construction: softmax routing depends only on the rows'
        # differences, whose conditioning is what tells the experts apart.
        centred = self.centred and self.vectors.shape[1] > 1
        warn_degenerate(self.vectors[:, 1:] - self.vectors[:, :1] if centred else self.vectors, self.name)

    def model_vectors(self, inputs, context):
        raise NotImplementedError

    def tensors(self, layer_idx, built, context) -> dict:
        rows = self.vectors[layer_idx].repeat_interleave(self.inputs.experts_per_model, dim=0)
        return {"weight": rows.float().contiguous()}

    @classmethod
    def check_experts(cls, experts) -> None:
        """One ValueError naming the first expert model without positive prompts, where the gate needs them."""
        for expert in experts:
            if cls.needs_prompts and not expert.positive_prompts:
                raise ValueError(
                    f"Expert {expert.describe()} has no positive_prompts: the {cls.name} gate starts each expert's "
                    "router row from its prompts."
                )


def normalized(vectors):
    """Each vector over its L2 norm (at least 1e-8, as mergekit divides)."""
    return vectors / vectors.norm(dim=-1, keepdim=True).clamp(min=1e-8)


def prompt_tokens(tokenizer, prompt: str) -> list[int]:
    """A prompt's ids as mergekit tokenizes it: the tokenizer's BOS text (if any) before it, no other special token."""
    ids = tokenizer((tokenizer.bos_token or "") + prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"The prompt {prompt!r} has no tokens.")
    return ids


def warn_degenerate(vectors, name: str) -> None:
    """Log the layers whose expert-model vectors (`[L, models, H]`) are nearly linearly dependent: the router can
    barely tell those experts apart (mergekit's `warn_degenerate_gates`)."""
    import torch

    layers = [i for i, layer in enumerate(vectors.float()) if torch.linalg.cond(layer) > DEGENERATE_CONDITION]
    if not layers:
        return
    where = "every layer" if len(layers) == len(vectors) else f"layer{'s' * (len(layers) > 1)} {_listed(layers)}"
    logger.warning(
        "The %s gate's expert vectors are nearly linearly dependent in %s (condition number above %g): the prompts "
        "or data may be too similar, and some experts will be underused.",
        name,
        where,
        DEGENERATE_CONDITION,
    )


def _listed(items: list[int]) -> str:
    return " and ".join(filter(None, [", ".join(map(str, items[:-1])), str(items[-1])]))

"""`hidden`: mergekit-moe's gate. Each expert model's row is the base model's hidden state at each decoder layer's
input over its positive prompts, minus the same over its negative prompts, L2-normalised per layer."""

from ..registry import ROUTER_INITS
from .expert_vectors import ExpertVectorRouter, prompt_tokens


@ROUTER_INITS.register("hidden")
class HiddenRouter(ExpertVectorRouter):
    description = (
        "mergekit's hidden gate: per layer, the base model's input state at each expert's positive prompts (last "
        "token, or the mean: hidden_token) minus its negative prompts', normalised (llama-moe merge)"
    )

    needs_prompts = True

    def model_vectors(self, inputs, context):
        """`[L, models, H]`: mean over the positive prompts minus mean over the negative ones, one pass for all."""
        import torch

        from ..layerwise import layer_input_states

        tokenizer = inputs.load_tokenizer()
        prompts = [(e.positive_prompts, e.negative_prompts) for e in inputs.experts]
        tokens = [prompt_tokens(tokenizer, p) for positive, negative in prompts for p in (*positive, *negative)]
        reduce = "last" if inputs.hidden_token == "last" else "mean"
        device = inputs.device or context.device
        states = layer_input_states(inputs.source, tokens, reduce, device, progress=context.progress)
        vectors, start = [], 0
        for positive, negative in prompts:
            middle, end = start + len(positive), start + len(positive) + len(negative)
            vector = states[:, start:middle].mean(dim=1)
            if negative:
                vector = vector - states[:, middle:end].mean(dim=1)
            vectors.append(vector)
            start = end
        return torch.stack(vectors, dim=1)

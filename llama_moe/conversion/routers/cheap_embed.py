"""`cheap_embed`: mergekit-moe's gate that runs no layer. Each expert model's row, the same in every layer, is the
normalised sum of its positive prompts' token embeddings minus the normalised sum of its negative prompts',
normalised."""

from ..registry import ROUTER_INITS
from .expert_vectors import ExpertVectorRouter, normalized, prompt_tokens


@ROUTER_INITS.register("cheap_embed")
class CheapEmbedRouter(ExpertVectorRouter):
    description = (
        "mergekit's cheap_embed gate: the normalised sum of each expert's positive prompts' token embeddings minus "
        "that of its negative prompts, the same row in every layer (llama-moe merge)"
    )

    needs_prompts = True

    def model_vectors(self, inputs, context):
        import torch

        tokenizer = inputs.load_tokenizer()
        embed = inputs.source.tensor("model.embed_tokens.weight")

        def embedded(prompts):
            ids = torch.tensor([i for prompt in prompts for i in prompt_tokens(tokenizer, prompt)], dtype=torch.long)
            return normalized(embed[ids].float().sum(dim=0))

        vectors = []
        for expert in inputs.experts:
            vector = embedded(expert.positive_prompts)
            if expert.negative_prompts:
                vector = vector - embedded(expert.negative_prompts)
            vectors.append(vector)
        return torch.stack(vectors)[None].expand(inputs.source.config.num_hidden_layers, -1, -1)

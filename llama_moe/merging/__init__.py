"""Merging several dense models of one source family into one MoE (mergekit-moe's job, Branch-Train-MiX's mix):

    config.py      MergeConfig / ExpertSource and the merge recipe file (merge_recipe.yaml)
    mergekit.py    mergekit-moe's YAML read as it is, with one line per key it does not support
    sources.py     the models opened and checked (one family, one shape), the non-FFN differences reported
    plan.py        the merge planned in one step: one model's FFN split as a conversion would, the gate over all
    pipeline.py    the streaming merge into an atomic folder (exported to Mixtral / Qwen2-MoE / Qwen3-MoE on request)
    add_expert.py  one more expert model into a merged MoE, every other expert and its routing unchanged
    card.py        the merged model's card

The gates are router inits of the conversion registry (`hidden`, `cheap_embed`, `random`, `uniform_random`,
`expert_data`, `trained`), which read each expert model's prompts or data from `ExpertInputs`.
"""

from .config import MERGE_RECIPE_FILE, ExpertSource, MergeConfig, config_from_dict

__all__ = ["MERGE_RECIPE_FILE", "ExpertSource", "MergeConfig", "config_from_dict"]

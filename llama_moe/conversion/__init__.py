"""Dense -> MoE conversion. The data path, as the files show it:

    recipe.py       MoERecipe (what to build) + RunOptions (how to run); recipe files
    registry.py     METHODS, ROUTER_INITS, FAMILIES: the extension points, by name
    methods/        one module per construction method      routers/    one per router initialisation
    families/       one module per model family              plan.py     the recipe checked, completed and planned
    calibration.py  the one context that runs the dense model for every component (text from `text`)
    pipeline.py     convert(): streaming and atomic, to a folder   build.py   build_moe(): in memory
    quick_check.py  perplexity of what was written next to the dense model's   conversion_card.py   its card
    healing/        each MoE MLP trained to reproduce the dense one: layer.py LayerHealer, folder.py `llama-moe heal`

It reads dense checkpoints through `checkpoints` (folder, Hub, GGUF, default model, in memory) as their source
family says (`source_families`), writes with `checkpoints.writer`, and cards with `hub`.

A component's algorithm lives with it: a method or router init that is more than its registry entry is a package
(`methods/carve/carving.py`, `methods/cluster/clustering.py`, `routers/selector/gmoefication.py`,
`routers/fit/attention_fit.py`; `methods/shared/importance.py` serves three methods). What stays here are the
pipeline's stages and their data: experts.py (splits and expert tensors), statistics.py (calibration passes),
layerwise.py (a model run a decoder layer at a time). This package imports nothing heavy; the `llama_moe` package
exports its public API.
"""

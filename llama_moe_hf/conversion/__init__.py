"""Dense -> MoE conversion. The data path, as the files show it:

    recipe.py       MoERecipe (what to build) + RunOptions (how to run); recipe files
    registry.py     METHODS, ROUTER_INITS, FAMILIES: the extension points, by name
    methods/        one module per construction method      routers/    one per router initialisation
    families/       one module per model family              plan.py     the recipe checked, completed and planned
    sources/        dense checkpoints, read a tensor at a time (folder, Hub, GGUF, default model, in memory)
    calibration.py  the calibration text, and the one context that runs the dense model for every component
    pipeline.py     convert(): streaming and atomic, to a folder   build.py   build_moe(): in memory
    writer.py       sharded safetensors writer, atomic folder      card.py, hub.py   model card and upload

The algorithms the components call live beside them: experts.py (splits and expert tensors), clustering.py,
importance.py, gmoefication.py, attention_fit.py, statistics.py (calibration passes). This package imports nothing
heavy; `llama_moe_hf` exports its public API.
"""

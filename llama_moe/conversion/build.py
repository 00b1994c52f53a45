"""The in-memory builder: a loaded dense model and a recipe give the MoE model, without touching disk.

It runs the same plan, calibration context and per-layer tensors as the streaming converter (`pipeline.convert`),
so what it returns equals what `llama-moe convert` writes. Tests and benchmarks build their models with it.
"""

from .recipe import MoERecipe


def build_moe(
    dense_model,
    recipe: MoERecipe | None = None,
    *,
    tokenizer=None,
    calibration_ids=None,
    context=None,
    progress: bool = False,
    **fields,
):
    """The MoE causal LM of `recipe` built from `dense_model` (a LLaMA-family causal LM), in memory.

    fields: recipe fields and component options by name, over `recipe` (`build_moe(model, method="upcycle")`).
    tokenizer: tokenizes the recipe's calibration data, for methods and routers that calibrate; or pass
        `calibration_ids` `[B, S]` directly.
    context: a `CalibrationContext` to reuse across builds with the same calibration settings (its statistics and
        passes are shared; the caller owns it and its reference to the dense model).
    The dense model is not modified; the MoE model has its dtype and device.
    """
    import torch
    from transformers.initialization import no_init_weights

    from ..checkpoints import ModelSource
    from .calibration import CalibrationContext
    from .healing.joint import heal_built_model
    from .plan import ConversionPlan

    recipe, run_fields = (recipe or MoERecipe()).with_fields(fields)
    if run_fields:
        raise ValueError(f"build_moe takes recipe fields, not the run options {sorted(run_fields)}.")
    source = ModelSource(dense_model, tokenizer)
    plan = ConversionPlan.create(recipe, dense_model.config)
    owned = context is None
    if owned:
        device = next(dense_model.parameters()).device
        context = CalibrationContext(
            plan.recipe,
            source.load_model,
            source.load_tokenizer,
            input_ids=calibration_ids,
            device=str(device),
            progress=progress,
        )
    elif not context.serves(plan.recipe):
        raise ValueError("The calibration context was made for other calibration settings than this recipe's.")
    plan.prepare(context)
    if owned:
        context.release()
    parameter = next(dense_model.parameters())
    plan.config.dtype = parameter.dtype  # what the tensors become (healing works on them as they will be)
    state = dict(plan.tensors(source, context))
    plan.config.conversion_info = plan.conversion_info(source.description, context)
    with no_init_weights(), torch.device(parameter.device):
        model = plan.family.model_class()(plan.config).to(parameter.dtype)
    missing, _ = model.load_state_dict(state, strict=False)  # copies: the MoE model shares nothing with the dense one
    if set(missing) - {"lm_head.weight"} or ("lm_head.weight" in missing) != plan.config.tie_word_embeddings:
        raise RuntimeError(f"The built model lacks {missing}.")
    model.tie_weights()
    heal_built_model(model, dense_model, context, plan.recipe, progress)  # where the recipe asks for it
    return model.eval()

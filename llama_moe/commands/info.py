"""`llama-moe info`: a converted model's MoE settings and parameter counts, described by its family's registry entry."""

import json

from .convert import parameters_text


def register(subparsers) -> None:
    parser = subparsers.add_parser("info", help="print a converted model's MoE settings and parameter counts")
    parser.add_argument("folder", help="a converted model: local folder or Hub id ORG/NAME")


def run(args) -> None:
    for line in info_lines(args.folder):
        print(line)


def info_lines(folder, download=None) -> list[str]:
    from transformers import AutoConfig

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)
    from llama_moe_hf.modeling import MODEL_FAMILIES  # noqa: F401  (registers the families: no remote code is run)

    from ..checkpoints.writer import read_shapes
    from ..conversion.registry import FAMILIES, count_parameters
    from ..hub.upgrade import code_status
    from ..loading import model_folder

    name, folder = folder, model_folder(str(folder), download=download)
    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in FAMILIES:
        raise ValueError(f"{folder} holds a {config.model_type!r} model, not one of {', '.join(FAMILIES)}.")
    family = FAMILIES[config.model_type]
    lines = [
        f"{name}: {type(config).__name__} ({config.model_type}: {family.description}), "
        f"{config.num_hidden_layers} layers"
    ]
    lines += family.info_lines(config)
    lines.append(source_line(getattr(config, "source_model_type", "llama")))
    lines += component_lines(family(), (getattr(config, "conversion_info", None) or {}).get("recipe", {}))
    if getattr(config, "conversion_info", None):
        lines.append(f"conversion: {json.dumps(config.conversion_info, sort_keys=True)}")
    total, active = count_parameters(config, read_shapes(folder))
    lines.append(parameters_text(total, active))
    code = code_status(folder, name)  # an old copy of the code may not run on the installed transformers
    return lines + ([code] if code else [])


def source_line(model_type: str) -> str:
    """The dense source family whose attention, norms and RoPE the model keeps."""
    from ..source_families import SOURCE_FAMILIES

    described = SOURCE_FAMILIES[model_type].description if model_type in SOURCE_FAMILIES else "not a known family"
    return f"source family: {model_type} ({described})"


def component_lines(family, recipe: dict) -> list[str]:
    """The construction method and router init of each block the recipe converted, described by their registries."""
    from ..conversion.recipe import MoERecipe
    from ..conversion.registry import METHODS, ROUTER_INITS

    try:
        kinds = family.target_kinds(MoERecipe.from_dict(dict(recipe)))
    except (TypeError, ValueError):  # no recipe, or one written by another version
        return []
    lines = []
    for kind in kinds:
        fields = family.parts[kind].fields()
        for key, registry in ((fields["method"], METHODS), (fields["router_init"], ROUTER_INITS)):
            if recipe.get(key) in registry:
                lines.append(f"{key.replace('_', ' ')}: {recipe[key]} ({registry[recipe[key]].description})")
    return lines

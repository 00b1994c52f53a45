"""One conversion, planned: the recipe checked and completed, its components chosen, the output config built.

resolve_recipe(recipe, run=run)         the settings checked (`settings.py`) and defaults filled, before the source
ConversionPlan.create(recipe, config)   completed for the source (`resolve_for_model`); the components of each
                                        target, the output config and tensor shapes
plan.request(context)                   what every component asks of the calibration (the forecast reads it)
plan.prepare(context)                   every calibration pass, once, before the write
plan.tensors(source, context)           the output checkpoint's tensors, one decoder layer at a time
"""

import dataclasses
import json
import time
from collections.abc import Iterator

from llama_moe_hf.modeling.configuration_llama_moe import DEFAULT_ROUTER_TYPE
from llama_moe_hf.modeling.routers import ROUTER_CLASSES

from .calibration import data_path
from .layer_patterns import layer_terms, parse_moe_layers
from .recipe import MoERecipe
from .registry import FAMILIES, METHODS, ROUTER_INITS, component_options, option_fields, option_owner
from .settings import ROUTER_TYPES, RunOptions, check_choice, check_types
from .target import BLOCKS, MLP, LayerBuild, Target


def resolve_recipe(recipe: MoERecipe, dense_config=None, run: RunOptions | None = None) -> MoERecipe:
    """`recipe` with every default filled in, or one ValueError for the first impossible setting.

    Without `dense_config` (before the source is opened) the settings that depend on the model's shape are left for
    `resolve_for_model`, which `ConversionPlan.create` runs on this result. Nothing is changed in place.
    """
    recipe = dataclasses.replace(recipe, moe_layers=_layer_list(recipe.moe_layers))
    recipe.check()
    if run is not None:
        run.check()
    recipe = dataclasses.replace(recipe, calibration_data=data_path(recipe))
    family = FAMILIES[recipe.family]()
    recipe = dataclasses.replace(recipe, family=family.name, options={**family.default_options(), **recipe.options})
    family.check(recipe)
    if recipe.heal_tokens and not family.heals:
        raise ValueError(f"--heal-tokens does not apply to the {family.name} family (no top-k MoE MLPs to heal).")
    recipe = _resolve_heal_target(family.resolve(recipe), family)
    for kind in family.target_kinds(recipe):
        recipe = _resolve_target(recipe, family, kind, run)
    recipe = _resolve_options(recipe, family)
    return recipe if dense_config is None else resolve_for_model(recipe, dense_config)


def resolve_for_model(recipe: MoERecipe, dense_config) -> MoERecipe:
    """A recipe `resolve_recipe` resolved without the source, completed for it: the family's defaults that depend on
    the model (AttnMoE's expert count), the score scales that needed them, the layer patterns against its depth."""
    family = FAMILIES[recipe.family]()
    recipe = family.resolve_for_model(recipe, dense_config)
    for kind in family.target_kinds(recipe):
        part = family.parts[kind]
        settings = part.read(recipe)
        if settings["score_scale_factor"] is None:
            recipe = part.write(recipe, score_scale_factor=_default_scale(settings))
        parse_moe_layers(settings["layers"], dense_config.num_hidden_layers)
    return recipe


def _default_scale(settings: dict) -> float | None:
    """The score scale a target's method and router init choose (None until its expert counts are known)."""
    if settings["num_experts"] is None or settings["top_k"] is None:
        return None
    router = ROUTER_INITS[settings["router_init"]]
    if router.unit_weights:
        return 1.0
    if router.even_weights:
        return float(settings["top_k"])
    return float(METHODS[settings["method"]].default_score_scale(settings["num_experts"], settings["top_k"]))


def _resolve_heal_target(recipe: MoERecipe, family) -> MoERecipe:
    """The stream target runs the dense model's states through the converted layers' attention: the default where
    only MLPs are converted, refused where the attention is too."""
    mlp_only = family.target_kinds(recipe) == [MLP]
    if recipe.heal_target is None:
        return dataclasses.replace(recipe, heal_target="stream" if mlp_only else "mlp")
    if recipe.heal_tokens and recipe.heal_target == "stream" and not mlp_only:
        raise ValueError(
            f"--heal-target stream needs the dense model's attention in every layer, which the {family.name} family "
            "converts too: use --heal-target mlp."
        )
    return recipe


def _layer_list(value):
    """A layer pattern as a list of strings: YAML and Python callers also write `[0, 2]` or `"last:2"`."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [str(term) for term in value]
    return value


def _resolve_target(recipe: MoERecipe, family, kind: str, run: RunOptions | None) -> MoERecipe:
    """The method, router init, gate and score scale of one target, checked and completed."""
    part = family.parts[kind]
    settings = part.read(recipe)
    method = METHODS[settings["method"]]
    if method.target != kind:
        raise ValueError(f"Method {method.name!r} builds {method.target} experts, not {kind} experts.")
    router = ROUTER_INITS[settings["router_init"] or method.default_router_init]
    if kind not in router.targets:
        usable = [n for n, init in ROUTER_INITS.items() if kind in init.targets and not init.needs_expert_inputs]
        raise ValueError(f"Router init {router.name!r} cannot start {kind} routers; choose one of {', '.join(usable)}.")
    router_type = settings["router_type"] or router.router_type or DEFAULT_ROUTER_TYPE
    _check_router(router, router_type, method, kind)
    if settings["num_shared_experts"] and not method.allows_shared_experts:
        raise ValueError(f"--num-shared-experts is not supported with method {method.name!r}.")
    if kind == MLP and recipe.compensation and not method.neuron_split:
        raise ValueError(f"--compensation needs a method that splits the FFN's neurons, not {method.name!r}.")
    if run is not None and (run.save_split or run.load_split) and kind == MLP and not method.uses_split_files:
        usable = [name for name, m in METHODS.items() if m.uses_split_files]
        raise ValueError(f"--save-split / --load-split work with the methods {', '.join(usable)}.")
    settings |= {"method": method.name, "router_init": router.name, "router_type": router_type}
    settings["layers"] = _layer_list(settings["layers"])
    layer_terms(settings["layers"])
    if settings["score_scale_factor"] is None:
        settings["score_scale_factor"] = _default_scale(settings)
    return part.write(recipe, **settings)


def _check_router(router, router_type: str, method, kind: str) -> None:
    if router_type not in ROUTER_TYPES:
        raise ValueError(f"Unknown router type {router_type!r}; choose one of {', '.join(ROUTER_TYPES)}.")
    if router.router_type is not None and router_type != router.router_type:
        raise ValueError(f"Router init {router.name!r} makes a {router.router_type!r} router, not {router_type!r}.")
    if router.even_weights and router_type != DEFAULT_ROUTER_TYPE:
        raise ValueError(
            f"Router init {router.name!r} makes renormalised softmax top-k routers ({DEFAULT_ROUTER_TYPE}), not "
            f"{router_type!r}."
        )
    forced = [init.name for _, init in ROUTER_INITS.items() if init.router_type == router_type]
    if forced and router.name not in forced:
        raise ValueError(f"A {router_type!r} router is made by router init {' or '.join(forced)}, not {router.name!r}.")
    if router.needs_neuron_split and not method.neuron_split:
        raise ValueError(
            f"Router init {router.name!r} needs a method that splits the FFN's neurons, not {method.name!r}."
        )
    if router.needs_representatives and not method.representative_neurons:
        usable = [name for name, m in METHODS.items() if m.representative_neurons]
        raise ValueError(
            f"Router init {router.name!r} needs a method that picks representative neurons ({', '.join(usable)}), "
            f"not {method.name!r}."
        )


def _chosen_components(recipe: MoERecipe, family) -> list:
    """The family and the methods and router inits of a resolved recipe."""
    chosen = [family]
    for kind in family.target_kinds(recipe):
        settings = family.parts[kind].read(recipe)
        chosen += [METHODS[settings["method"]], ROUTER_INITS[settings["router_init"]]]
    return chosen


def _resolve_options(recipe: MoERecipe, family) -> MoERecipe:
    """Keep exactly the options of the family and of the chosen methods and router inits, with their defaults."""
    accepted = {
        f.name: (component, f) for component in _chosen_components(recipe, family) for f in option_fields(component)
    }
    for key in recipe.options:
        if key not in accepted:
            owner = option_owner(key)
            if owner is None:
                raise ValueError(f"Unknown option {key!r}.")
            flag, (registry, name) = f"--{key.replace('_', '-')}", owner
            if registry is FAMILIES:
                raise ValueError(
                    f"{flag} is an option of the {name} family, not of {family.name}: add --family {name}."
                )
            raise ValueError(f"{flag} applies to {registry.kind} {name!r}, which is not used.")
    options = {key: recipe.options.get(key, f.default) for key, (_, f) in accepted.items()}
    for component in {component for component, _ in accepted.values()}:
        check_types(component_options(component, options))
        for f in option_fields(component):
            choices = f.metadata.get("choices")
            if choices and options[f.name] is not None:
                check_choice(f.name, options[f.name], choices)
    return dataclasses.replace(recipe, options=options)


def recipe_as_asked(asked: MoERecipe, resolved: MoERecipe) -> MoERecipe:
    """The recipe an output folder carries: `asked`, with its family and the options of every component it uses
    named (their defaults where not set). Settings `asked` leaves to the components (None: the score scale N/k, the
    method's router init, the attention experts, ...) stay None, so that flags overriding the saved file work them out
    again rather than keep values made for other settings; the config's `conversion_info` has the values used."""
    family = FAMILIES[resolved.family]()
    defaults = {f.name: f.default for c in _chosen_components(resolved, family) for f in option_fields(c)}
    options = {key: asked.options.get(key, defaults[key]) for key in resolved.options}
    return dataclasses.replace(
        asked,
        family=resolved.family,
        moe_layers=_layer_list(asked.moe_layers),
        calibration_data=resolved.calibration_data,
        options=options,
    )


@dataclasses.dataclass
class ConversionPlan:
    """A resolved recipe turned into components: per target (`mlp`, `attention`) its `Target` settings and its
    (construction method, router init) instances; the output `config` and the shape of every output tensor."""

    recipe: MoERecipe
    run: RunOptions
    family: object
    dense_config: object
    targets: dict[str, Target]
    components: dict[str, tuple] = dataclasses.field(default_factory=dict)
    config: object = None
    expected: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    meta_model: object = None  # the output model on the meta device: the shapes, and the code to save
    asked: MoERecipe | None = None  # the recipe file the output carries (`recipe_as_asked`)
    healer: object = None  # `healing.LayerHealer` of the write, when the recipe heals
    forecast: dict | None = None  # each stage's forecast memory and disk (`forecast.py`), in `conversion_info`
    joint_deferred: object = None  # the joint stage's `forecast.Stage`, where it is left to a training run
    requested: bool = False  # the components have asked the calibration context for their statistics
    # each stage's expected and measured seconds: logged at the end, not saved (the config is the same on a rerun)
    expected_seconds: dict = dataclasses.field(default_factory=dict)
    stage_seconds: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def create(
        cls, recipe: MoERecipe, dense_config, run: RunOptions | None = None, *, resolved: MoERecipe | None = None
    ) -> "ConversionPlan":
        """Check and complete `recipe` against the dense model's config; one ValueError for the first impossible
        setting (the output config's own checks included). `resolved`: `resolve_recipe(recipe, run=run)` done
        already (before the source was opened), which is then only completed for the model."""
        run = run or RunOptions()
        if resolved is None:
            resolved = resolve_recipe(recipe, run=run)
        asked, recipe = recipe, resolve_for_model(resolved, dense_config)
        family = FAMILIES[recipe.family]()
        targets = {kind: plan_target(recipe, family, kind, dense_config) for kind in family.target_kinds(recipe)}
        plan = cls(recipe, run, family, dense_config, targets, asked=recipe_as_asked(asked, recipe))

        plan.components = {
            kind: (
                METHODS[t.method](recipe, t, dense_config, run),
                ROUTER_INITS[t.router_init](recipe, t, dense_config, run),
            )
            for kind, t in targets.items()
        }
        plan.build_output()
        return plan

    def build_output(self) -> None:
        """The output config, the model on the meta device and every tensor's shape, from the targets and
        components."""
        import torch
        from huggingface_hub.errors import StrictDataclassError

        try:
            self.config = self.family.build_config(self.dense_config, self.recipe, self)
        except StrictDataclassError as error:  # a wrongly typed setting: one ValueError like the others
            raise ValueError(str(error)) from None
        self.config.architectures = [self.family.model_class().__name__]
        with torch.device("meta"):
            self.meta_model = self.family.model_class()(self.config)
        self.expected = {name: tuple(t.shape) for name, t in self.meta_model.state_dict().items()}
        if self.config.tie_word_embeddings:
            self.expected.pop("lm_head.weight", None)

    def request(self, context) -> None:
        """Every component asks `context` for its statistics (nothing is computed yet), once."""
        if self.requested:
            return
        for method, router in self.components.values():
            method.request(context)
            router.request(context)
        if self.recipe.compensation:  # each expert's mean output: the layers' mean activations
            context.request_mlp(self.targets[MLP].layers)
        self.requested = True

    def prepare(self, context) -> None:
        """The requests (`request`), one calibration pass recording them all, then the components compute what the
        layers need (gradient passes and k-means included). The caller releases the model."""
        start = time.perf_counter()
        self.request(context)
        context.collect()
        for method, router in self.components.values():
            method.prepare(context)
            router.prepare(context)
        made = getattr(context, "text_seconds", 0.0)  # the text the dense model made (a merge's context makes none)
        self.stage_seconds["calibration"] = round(time.perf_counter() - start - made, 1)

    def tensors(self, source, context, progress: bool = False) -> Iterator[tuple[str, object]]:
        """(name, tensor) of the whole output checkpoint, one decoder layer at a time, checked against the plan."""
        from tqdm.auto import tqdm

        embeddings = source.tensor("model.embed_tokens.weight")
        yield self._checked("model.embed_tokens.weight", embeddings)
        self.healer = self._healer(embeddings, context, source) if self.recipe.heal_tokens else None
        del embeddings  # not held through the layers (1 GB of Llama-3-8B's vocabulary in bfloat16)
        layers = range(self.config.num_hidden_layers)
        what = "Converting and healing layers" if self.healer else "Converting layers"
        for layer_idx in tqdm(layers, desc=what, unit="layer", disable=not progress):
            prefix = f"model.layers.{layer_idx}."
            dense = source.layer_tensors(layer_idx)
            tensors = self.layer_tensors(layer_idx, dense, context)
            if self.healer is not None:  # on the tensors as written, so that healing later gives the same
                tensors = {k: v.to(self.config.dtype) for k, v in tensors.items()}  # the others freed first
                tensors = self.healer.heal(layer_idx, tensors, dense)
            for name, tensor in tensors.items():
                yield self._checked(prefix + name, tensor)
        yield self._checked("model.norm.weight", source.tensor("model.norm.weight"))
        if not self.config.tie_word_embeddings:
            yield self._checked("lm_head.weight", source.tensor("lm_head.weight"))
        for method, router in self.components.values():
            method.finish(context)

    def _healer(self, embeddings, context, source):
        """The `LayerHealer` of this write: the heal tokens of the calibration data, on the run's device, resuming
        from `heal_state_dir` when an interrupted run of the same conversion left it."""
        from .healing.layer import LayerHealer

        identity = json.dumps([dataclasses.asdict(self.asked), source.description], default=str)
        tokens = context.tokens(self.recipe.heal_tokens)
        return LayerHealer.for_model(
            self.recipe, self.meta_model, embeddings, tokens, self.run.device, self.heal_state_dir, identity
        )

    @property
    def heal_state_dir(self):
        """Where healing keeps its per-layer progress until the output is written (None: no healing)."""
        from .healing.layer import state_dir_for

        return state_dir_for(self.run.output) if self.recipe.heal_tokens and self.run.output else None

    def layer_tensors(self, layer_idx: int, dense: dict, context) -> dict:
        """One decoder layer's output tensors (keyed under the layer) from its dense tensors."""
        tensors = dict(dense)
        for kind, target in self.targets.items():
            if layer_idx not in target.layers:
                continue
            prefix = BLOCKS[kind] + "."
            block = {k[len(prefix) :]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
            tensors.update({prefix + k: v for k, v in self._block_tensors(kind, layer_idx, block, context).items()})
        return tensors

    def _block_tensors(self, kind: str, layer_idx: int, dense: dict, context) -> dict:
        method, router = self.components[kind]
        built = method.build(layer_idx, dense, context)
        tensors = dict(built.tensors)
        gate = method.router_tensors(router.tensors(layer_idx, built, context))
        gate_class = ROUTER_CLASSES.get(self.targets[kind].router_type)  # None: SoapMoE's experts have no gate type
        for name in gate_class.untrained_tensors if gate_class else ():  # e.g. no noise until it is trained
            gate.setdefault(name, gate["weight"].new_zeros(gate["weight"].shape))
        tensors.update({f"gate.{name}": tensor for name, tensor in gate.items()})
        if kind == MLP and self.recipe.compensation:
            tensors["compensation"] = self._compensation(layer_idx, built, context)
        return tensors

    @staticmethod
    def _compensation(layer_idx: int, built: LayerBuild, context):
        from .routers.selector.gmoefication import compensation_table

        return compensation_table(built.split, built.dense["down_proj.weight"], context.mlp(layer_idx).mean_activation)

    def _checked(self, name: str, tensor):
        if name not in self.expected:
            raise ValueError(f"Conversion produced an unexpected tensor {name} (the output model has no such weight).")
        if tuple(tensor.shape) != self.expected[name]:
            raise ValueError(
                f"Conversion produced {name} with shape {tuple(tensor.shape)}, expected {self.expected[name]}."
            )
        return name, tensor

    def conversion_info(self, source_description: str, context) -> dict:
        """`config.conversion_info`: the recipe, the source, and what the components report."""
        info = {"recipe": self.recipe.to_dict(), "source": source_description}
        if context.used:
            info["calibration_data"] = context.data_description
        for method, router in self.components.values():
            info.update(method.info())
            info.update(router.info())
        if self.healer is not None:
            info.update(self.healer.info())
        if self.forecast is not None:
            info["forecast"] = self.forecast
        return info


def plan_target(recipe: MoERecipe, family, kind: str, dense_config) -> Target:
    """The `Target` of one part of a resolved recipe, its layers read against the model's depth."""
    settings = family.parts[kind].read(recipe)
    layers = parse_moe_layers(settings.pop("layers"), dense_config.num_hidden_layers)
    shared = settings.pop("num_shared_experts") or 0
    return Target(kind=kind, **settings, num_shared_experts=shared, layers=tuple(layers))

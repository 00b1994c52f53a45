"""Every setting of a conversion, declared once with its check.

    RecipeFields   what to build: the core `llama-moe convert` flags (`MoERecipe` adds the components' options)
    RunOptions     how to run it: paths, dtype, device, card and Hub settings
    Part           which recipe field holds each setting of a block that becomes experts, by the name the plan
                   (`target.Target`) and the families' config builders use

A flag reaches the saved config through three names: the flag / recipe field (`--top-k`, `top_k`; SoapMoE's
`--merge-top-k`), the plan's `Target.top_k`, and the config field the family writes (`num_experts_per_tok`). The
components' own options are declared next to each component (`option(...)` in `methods/`, `routers/`, `families/`);
`plan.resolve_recipe` fills the defaults that depend on other settings or on the source model.

This module imports nothing heavy: the command line reads it to answer `--help`.
"""

import ast
import dataclasses
import importlib.util
import types
import typing
from pathlib import Path
from typing import Any

from ..source_families import SOURCE_FAMILIES
from .layer_patterns import layer_terms
from .target import MLP

HEAL_SCHEDULES = ("constant", "cosine", "linear")  # healing's learning rate over each layer's steps
HEAL_TARGETS = ("stream", "mlp")  # what healing trains each MoE MLP to reproduce


def _model_code() -> Path:
    """`llama_moe_hf/modeling`, found, not imported: importing it registers the families (torch)."""
    return Path(importlib.util.find_spec("llama_moe_hf").submodule_search_locations[0]) / "modeling"


def _model_constant(file: str, name: str) -> tuple[str, ...]:
    """The literal tuple `name = (...)` of `llama_moe_hf/modeling/<file>`, read without importing it."""
    tree = ast.parse((_model_code() / file).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError(f"modeling/{file} defines no {name}")


def _router_types() -> tuple[str, ...]:
    """The `router_type` of each gate class in `llama_moe_hf/modeling/routers.py`, in order, read without importing
    it (defining a class registers it there)."""
    tree = ast.parse((_model_code() / "routers.py").read_text())
    names = []
    for node in tree.body:
        for item in node.body if isinstance(node, ast.ClassDef) else ():
            if isinstance(item, ast.Assign) and any(getattr(t, "id", None) == "router_type" for t in item.targets):
                names += [item.value.value] if item.value.value else []  # the base class's "" names no gate
    return tuple(names)


ROUTER_TYPES = _router_types()
ATTENTION_GRANULARITIES = _model_constant("configuration_attn_moe.py", "ATTENTION_EXPERT_GRANULARITIES")
ROUTING_MODES = _model_constant("configuration_soap_moe.py", "ROUTING_MODES")
DTYPES = ("float32", "bfloat16", "float16")  # output weights


@dataclasses.dataclass(frozen=True)
class RecipeFields:
    """The core fields of a recipe (each a `llama-moe convert` flag); component options are in `MoERecipe.options`.
    The MLP's block settings among them are named by `MLP_PART`."""

    family: str = dataclasses.field(
        default="llama_moe",
        metadata={"help": "output model family: its options (listed below) apply only when it is chosen"},
    )
    method: str = dataclasses.field(default="random", metadata={"help": "MLP expert construction method"})
    num_experts: int = dataclasses.field(default=8, metadata={"help": "routed experts per MoE layer"})
    top_k: int = dataclasses.field(default=2, metadata={"help": "experts per token"})
    num_shared_experts: int = dataclasses.field(default=0, metadata={"help": "always-on experts (split methods)"})
    score_scale_factor: float | None = dataclasses.field(
        default=None,
        metadata={
            "help": "expert output scale (default: N/k for splits but residual; 1.0 for residual, upcycling and "
            "selector or analytical routers)",
        },
    )
    router_type: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "gate of the routers (default: what the router init needs, else top_k)",
        },
    )
    router_init: str | None = dataclasses.field(
        default=None,
        metadata={"help": "where the MLP routers' weights come from (default: the method's)"},
    )
    compensation: bool = dataclasses.field(
        default=False,
        metadata={"help": "G-MoEfication: store each expert's mean output and add it for the experts a token skips"},
    )
    moe_layers: list[str] | None = dataclasses.field(
        default=None,
        metadata={
            "help": "decoder layers to convert: '0 2 5', '0-7', 'last:2', 'every:2', 'all' (default: all)",
        },
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of random splits and router inits"})
    calibration_data: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "text/json/jsonl/parquet file or folder, a datasets name, builtin:mixed, or text the dense model "
            "makes: builtin:chat (chat prompts it answers, in its chat template), builtin:self (text it samples from "
            "its start token), builtin:chat-mixed / builtin:chat-self (conversations with builtin:mixed's documents / "
            "sampled texts in turn) (default: built-in corpus of docstrings)"
        },
    )
    calibration_tokens: int = dataclasses.field(default=8192, metadata={"help": "calibration tokens"})
    calibration_seq_len: int = dataclasses.field(default=256, metadata={"help": "tokens per calibration sequence"})
    calibration_samples: int = dataclasses.field(
        default=8192,
        metadata={
            "help": "MLP inputs kept per layer for selectors, k-means and activation clustering; memory: "
            "samples x hidden x 4 bytes x layers"
        },
    )
    heal_tokens: int = dataclasses.field(
        default=0,
        metadata={
            "help": "heal each MoE MLP after it is built: train it on this many calibration tokens, on the converted "
            "earlier layers' states, to reproduce the dense model (--heal-target; 0: no healing; docs/construction.md)"
        },
    )
    heal_epochs: int = dataclasses.field(default=4, metadata={"help": "healing: passes over the heal tokens"})
    heal_lr: float = dataclasses.field(default=3e-3, metadata={"help": "healing: Adam learning rate"})
    heal_batch_tokens: int = dataclasses.field(default=512, metadata={"help": "healing: tokens per step"})
    heal_schedule: str = dataclasses.field(
        default="constant",
        metadata={"help": "healing: learning-rate schedule over each layer's steps", "choices": HEAL_SCHEDULES},
    )
    heal_target: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "healing: what each MoE MLP learns: stream (the dense model's hidden states after the layer: each "
            "layer also undoes the earlier layers' drift) or mlp (the dense MLP's output on the converted model's "
            "states); default stream, mlp where the attention is converted too",
            "choices": HEAL_TARGETS,
        },
    )
    heal_routing_weight: float = dataclasses.field(
        default=0.1,
        metadata={"help": "healing: weight of the term that ranks the router's experts by what leaving them out costs"},
    )
    joint_heal_tokens: int = dataclasses.field(
        default=0,
        metadata={
            "help": "after the layer-wise heal, train every layer together on this many calibration tokens (those "
            "after the --heal-tokens) to match the dense model's next-token distributions (distillation; 0: off; "
            "docs/construction.md)"
        },
    )
    joint_heal_lr: float = dataclasses.field(default=2e-4, metadata={"help": "joint healing: AdamW learning rate"})
    joint_heal_kl_weight: float = dataclasses.field(
        default=0.5,
        metadata={
            "help": "joint healing: weight of the KL to the dense model against the calibration text's LM loss (1: "
            "KL alone, pure distillation)"
        },
    )

    def check(self) -> None:
        """One ValueError for the first impossible value among these fields (types, ranges, choices)."""
        check_types(self)
        for name in ("num_experts", "calibration_tokens", "calibration_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be at least 1, got {getattr(self, name)}.")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"--top-k must be between 1 and --num-experts={self.num_experts}, got {self.top_k}.")
        if self.num_shared_experts < 0:
            raise ValueError(f"--num-shared-experts must be >= 0, got {self.num_shared_experts}.")
        if self.calibration_seq_len < 2:
            raise ValueError(f"--calibration-seq-len must be at least 2, got {self.calibration_seq_len}.")
        if self.calibration_tokens < self.calibration_seq_len:
            raise ValueError(
                f"--calibration-tokens ({self.calibration_tokens}) must be at least one sequence "
                f"({self.calibration_seq_len} tokens)."
            )
        layer_terms(self.moe_layers)
        self._check_healing()

    def _check_healing(self) -> None:
        if self.joint_heal_tokens and self.joint_heal_tokens < self.calibration_seq_len:
            raise ValueError(
                f"--joint-heal-tokens ({self.joint_heal_tokens}) must be 0 or at least one calibration sequence "
                f"({self.calibration_seq_len} tokens)."
            )
        if self.joint_heal_lr <= 0:
            raise ValueError(f"--joint-heal-lr must be > 0, got {self.joint_heal_lr}.")
        if not 0 <= self.joint_heal_kl_weight <= 1:
            raise ValueError(f"--joint-heal-kl-weight must be between 0 and 1, got {self.joint_heal_kl_weight}.")
        if self.heal_tokens < 0:
            raise ValueError(f"--heal-tokens must be >= 0, got {self.heal_tokens}.")
        if not self.heal_tokens:
            return
        if self.heal_tokens < self.calibration_seq_len:
            raise ValueError(
                f"--heal-tokens ({self.heal_tokens}) must be at least one calibration sequence "
                f"({self.calibration_seq_len} tokens)."
            )
        for name in ("heal_epochs", "heal_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be at least 1, got {getattr(self, name)}.")
        if self.heal_lr <= 0 or self.heal_routing_weight < 0:
            raise ValueError("--heal-lr must be > 0 and --heal-routing-weight >= 0.")
        check_choice("heal_schedule", self.heal_schedule, HEAL_SCHEDULES)
        if self.heal_target is not None:  # None: chosen for the family by `plan.resolve_recipe`
            check_choice("heal_target", self.heal_target, HEAL_TARGETS)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How to run a conversion: source and output paths, dtype, device, card and Hub settings."""

    model: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "local folder, Hub repo id or .gguf file of a dense model of the source families "
            f"{', '.join(SOURCE_FAMILIES)} (default: SmolLM2-135M-Instruct)"
        },
    )
    tokenizer: str | None = dataclasses.field(
        default=None, metadata={"help": "tokenizer folder or Hub id, for a --model without one (default: --model's)"}
    )
    output: str | None = dataclasses.field(default=None, metadata={"help": "output folder (must not exist)"})
    overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "replace an existing output folder at the end"}
    )
    dtype: str | None = dataclasses.field(
        default=None, metadata={"help": "output weights dtype (default: the source's)", "choices": DTYPES}
    )
    max_shard_size: str = dataclasses.field(default="5GB", metadata={"help": "largest safetensors shard"})
    device: str | None = dataclasses.field(
        default=None, metadata={"help": "device of the calibration passes (default: cuda if available, else cpu)"}
    )
    calibration_batch_size: int = dataclasses.field(default=4, metadata={"help": "sequences per calibration pass"})
    offload_dir: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "folder where a gradient calibration pass keeps each layer's input states (default: memory, or a "
            "temporary folder when they would take more than a quarter of the free memory)"
        },
    )
    save_split: str | None = dataclasses.field(
        default=None, metadata={"help": "write the calibrated split and routers to this .safetensors file"}
    )
    load_split: str | None = dataclasses.field(
        default=None, metadata={"help": "reuse a split file written by --save-split instead of calibrating"}
    )
    revision: str | None = dataclasses.field(default=None, metadata={"help": "Hub revision of --model"})
    token: str | None = dataclasses.field(default=None, metadata={"help": "Hugging Face token (default: logged-in)"})
    allow_pickle: bool = dataclasses.field(
        default=False, metadata={"help": "accept pickled pytorch_model.bin sources (runs pickle code)"}
    )
    base_model: str | None = dataclasses.field(
        default=None, metadata={"help": "Hub id of the source for the model card (automatic for Hub sources)"}
    )
    license: str | None = dataclasses.field(
        default=None, metadata={"help": "model card license (default: the source's, if its README.md says)"}
    )
    repo_id: str | None = dataclasses.field(
        default=None, metadata={"help": "Hub repository ORG/NAME (also used in the model card's snippets)"}
    )
    push_to_hub: bool = dataclasses.field(default=False, metadata={"help": "upload the result to --repo-id"})
    private: bool = dataclasses.field(default=False, metadata={"help": "create the Hub repository as private"})
    progress: bool = dataclasses.field(default=True, metadata={"help": "show progress bars"})
    force: bool = dataclasses.field(
        default=False,
        metadata={"help": "convert even where the forecast says a stage will not fit in the free memory or disk"},
    )
    defer_joint_heal: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "write the layer-wise result and the joint stage's text, and end with the training command that "
            "runs that stage (what happens by itself when it would not fit in the free memory)"
        },
    )
    eval: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "after writing, check what the output kept of its source: its answers to held-out chat prompts "
            "and its KL on licence text, next to the dense model's (skipped above 1.5B parameters)"
        },
    )

    def check(self) -> None:
        """One ValueError for the first impossible value among the run options."""
        check_types(self)
        check_dtype(self.dtype)
        if self.calibration_batch_size < 1:
            raise ValueError(f"--calibration-batch-size must be at least 1, got {self.calibration_batch_size}.")
        if self.offload_dir is not None and not Path(self.offload_dir).expanduser().is_dir():
            raise ValueError(f"--offload-dir {self.offload_dir} is not a folder.")


@dataclasses.dataclass(frozen=True)
class Part:
    """A block of the decoder layers that becomes experts (`kind`: `mlp` or `attention`), and the recipe field or
    component option holding each of its settings, named as in `target.Target`. None: the part has no such setting
    (SoapMoE's experts have no gate type)."""

    kind: str
    method: str = "method"
    num_experts: str = "num_experts"
    top_k: str = "top_k"
    num_shared_experts: str | None = "num_shared_experts"
    score_scale_factor: str = "score_scale_factor"
    router_type: str | None = "router_type"
    router_init: str = "router_init"
    layers: str = "moe_layers"

    def fields(self) -> dict[str, str]:
        """Target setting -> the recipe field or option that holds it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[1:] if getattr(self, f.name)}

    def read(self, recipe) -> dict[str, Any]:
        """Every Target setting of the part in `recipe` (a setting the part lacks, or an option not set yet: None)."""
        names = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[1:]}
        return {setting: name and _read(recipe, name) for setting, name in names.items()}

    def write(self, recipe, **values):
        """`recipe` with these Target settings replaced (settings the part does not have are left out)."""
        names = {self.fields()[setting]: value for setting, value in values.items() if setting in self.fields()}
        fields = {name: value for name, value in names.items() if name in recipe.__dataclass_fields__}
        options = {name: value for name, value in names.items() if name not in fields}
        return dataclasses.replace(recipe, **fields, options={**recipe.options, **options})


MLP_PART = Part(MLP)  # an MLP MoE: the recipe's core fields


def _read(recipe, name: str):
    return getattr(recipe, name) if name in recipe.__dataclass_fields__ else recipe.options.get(name)


def flag(name: str) -> str:
    """The command-line flag of a setting: `top_k` -> `--top-k`."""
    return "--" + name.replace("_", "-")


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)} (or leave it unset).")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{flag(name)} must be one of {', '.join(choices)}, got {value!r}.")


def check_types(instance) -> None:
    """One ValueError for a field whose value does not have the annotated type (recipes come from YAML and
    keyword arguments, which argparse does not check). Integers are accepted where floats are expected."""
    hints = typing.get_type_hints(type(instance))
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if not _has_type(value, hints[field.name]):
            raise ValueError(f"{field.name} must be {_type_name(hints[field.name])}, got {value!r}.")


def _has_type(value, annotation) -> bool:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in args)
    if annotation is type(None):
        return value is None
    if origin in (list, tuple):  # list[X] and tuple[X, ...]
        return isinstance(value, origin) and all(_has_type(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _type_name(annotation) -> str:
    return str(annotation).replace("typing.", "").replace("NoneType", "None")

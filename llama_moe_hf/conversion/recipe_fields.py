"""The core fields of a conversion recipe, each a `llama-moe convert` flag: a module of its own, imported by the
recipe (`recipe.MoERecipe`) and by the model families, whose MLP settings they are (`target.Part`)."""

import dataclasses

from .choices import HEAL_SCHEDULES, HEAL_TARGETS


@dataclasses.dataclass(frozen=True)
class RecipeFields:
    """The core fields of a recipe (each a `llama-moe convert` flag); component options are in `MoERecipe.options`.
    The fields with a `role` are the MLP's block settings (`target.Part`)."""

    family: str | None = dataclasses.field(
        default=None,
        metadata={"help": "output model family (default: the family whose options are set, else llama_moe)"},
    )
    method: str = dataclasses.field(
        default="random", metadata={"help": "MLP expert construction method", "role": "method"}
    )
    num_experts: int = dataclasses.field(
        default=8, metadata={"help": "routed experts per MoE layer", "role": "num_experts"}
    )
    top_k: int = dataclasses.field(default=2, metadata={"help": "experts per token", "role": "top_k"})
    num_shared_experts: int = dataclasses.field(
        default=0, metadata={"help": "always-on experts (split methods)", "role": "num_shared_experts"}
    )
    score_scale_factor: float | None = dataclasses.field(
        default=None,
        metadata={
            "help": "expert output scale (default: N/k for splits but residual; 1.0 for residual, upcycling and "
            "selector or analytical routers)",
            "role": "score_scale_factor",
        },
    )
    router_type: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "gate of the routers (default: what the router init needs, else top_k)",
            "role": "router_type",
        },
    )
    router_init: str | None = dataclasses.field(
        default=None,
        metadata={"help": "where the MLP routers' weights come from (default: the method's)", "role": "router_init"},
    )
    compensation: bool = dataclasses.field(
        default=False,
        metadata={"help": "G-MoEfication: store each expert's mean output and add it for the experts a token skips"},
    )
    moe_layers: list[str] | None = dataclasses.field(
        default=None,
        metadata={
            "help": "decoder layers to convert: '0 2 5', '0-7', 'last:2', 'every:2', 'all' (default: all)",
            "role": "layers",
        },
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of random splits and router inits"})
    calibration_data: str | None = dataclasses.field(
        default=None,
        metadata={"help": "text/json/jsonl/parquet file or folder, or a datasets name (default: built-in corpus)"},
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

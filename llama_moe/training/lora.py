"""LoRA for the SFT recipe: TRL's `ModelConfig` fields (`use_peft`, `lora_r`, `lora_alpha`, `lora_target_modules`,
`lora_target_parameters` for the fused experts' 3-D tensors, ...) build the PEFT config as `trl sft` does; routers
are frozen with the rest of the base model unless `lora_train_routers` trains them in full (saved with the adapter as
`modules_to_save`). The recipe's output is the merged model, loadable without PEFT, with the adapter beside it in
`adapter/` (base + adapter equals the merged model; tested)."""

import json
from pathlib import Path

ADAPTER_FOLDER = "adapter"


def router_module_names(model) -> list[str]:
    """The last name part of every router module (classes named ...Router): what PEFT's `modules_to_save` matches."""
    names = {
        name.rsplit(".", 1)[-1] for name, module in model.named_modules() if type(module).__name__.endswith("Router")
    }
    if not names:
        raise ValueError(f"lora_train_routers: {type(model).__name__} has no router modules.")
    return sorted(names)


def check_lora(values) -> None:
    """The SFT recipe's LoRA settings (parsed values; other recipes have none), before any model loads."""
    if not getattr(values, "use_peft", False):
        if getattr(values, "lora_train_routers", False):
            raise ValueError("lora_train_routers needs use_peft (LoRA); without it every router trains anyway.")
        return
    if values.lora_target_parameters and values.lora_dropout:
        raise ValueError(
            "lora_target_parameters (LoRA on the fused experts) needs lora_dropout: 0 (PEFT's ParamWrapper has no "
            f"dropout); got {values.lora_dropout}."
        )
    if getattr(values, "distill", "none") != "none":
        raise ValueError("use_peft: LoRA is set up for distill: none (SFTTrainer); distillation trains the full model.")
    if getattr(values, "deepspeed", None) or getattr(values, "fsdp", None):
        raise ValueError("use_peft: merging the adapter needs whole weights; run LoRA with DDP, not ZeRO or FSDP.")
    if values.lora_train_routers and values.freeze_routers:
        raise ValueError("lora_train_routers and freeze_routers contradict each other: choose one.")


def lora_config(model_args, model, train_routers: bool):
    """The PEFT config of `model_args` (None without `use_peft`; `check_lora` has passed), with the routers trained
    in full if asked."""
    from trl import get_peft_config

    config = get_peft_config(model_args)
    if config is None:
        return None
    if train_routers:
        config.modules_to_save = sorted(set(config.modules_to_save or []) | set(router_module_names(model)))
    return config


def is_peft_model(model) -> bool:
    return hasattr(model, "merge_and_unload") and hasattr(model, "peft_config")


def save_adapter_and_merge(trainer, source: str, folder: Path) -> dict:
    """Write the trained adapter to `folder` (main process) and put the merged model in the trainer for the final
    save; returns the adapter's settings for the stage record."""
    from .checkpoint import unwrapped

    model = unwrapped(trainer)
    config = model.peft_config["default"]
    if trainer.is_world_process_zero():
        model.save_pretrained(folder)  # PEFT reads the base's config from `source` here
        written = json.loads((folder / "adapter_config.json").read_text())
        written["base_model_name_or_path"] = Path(source).name  # a name, never a local path: it may be published
        (folder / "adapter_config.json").write_text(json.dumps(written, indent=2) + "\n")
        (folder / "README.md").unlink(missing_ok=True)  # PEFT's placeholder card names the local base; ours covers it
    merged = model.merge_and_unload()
    trainer.model = trainer.model_wrapped = merged
    targets = sorted(config.target_modules or []) + sorted(config.target_parameters or [])
    return {"r": config.r, "alpha": config.lora_alpha, "targets": targets, "trained_in_full": config.modules_to_save}

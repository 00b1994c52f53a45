"""The model card (README.md) of a converted checkpoint: Hub metadata, every conversion setting, parameter counts,
and how to load the model with and without this package."""

import json
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

TAGS = ["moe", "mixture-of-experts", "llama-moe", "llama", "llama-moe-hf"]
ROUTER_INIT_TEXT = {
    "random": "random normal (std = initializer_range {std}, seeded)",
    "zero": "zeros (every expert gets the same score until trained)",
    "kmeans": "balanced k-means centroids of the calibration MLP inputs (LLaMA-MoE v2)",
    "selector": "MoEfication's expert selector trained on calibration data (G-MoEfication, unit expert weights)",
}


def _human(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def render_model_card(config, options, source, total: int, active: int, model_id: str) -> str:
    """The README.md text. `model_id` (the Hub repo id if known, else the output folder) goes into the snippets."""
    from .convert import METHODS  # the method registry describes each method

    info = config.conversion_info or {}
    base_model = options.base_model or source.hub_id
    data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=options.license or source.license,
        tags=TAGS + [f"moe-{options.method}"],
    )
    method = METHODS[options.method]
    moe_layers = config.moe_layers
    layers_text = (
        f"all {config.num_hidden_layers}"
        if len(moe_layers) == config.num_hidden_layers
        else f"{len(moe_layers)} of {config.num_hidden_layers}: {moe_layers}"
    )
    base_text = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else f"`{source.description}`"
    settings = [
        ("Method", f"`{options.method}`: {method.description}"),
        ("Routed experts per MoE layer", config.num_experts),
        ("Experts per token (top-k)", config.num_experts_per_tok),
        ("Shared (always-on) experts", config.num_shared_experts),
        ("Expert intermediate size", f"{config.moe_intermediate_size} (dense FFN: {config.intermediate_size})"),
        ("MoE layers", layers_text),
        (
            "Router",
            f"`{config.router_type}`, initialised to "
            + ROUTER_INIT_TEXT[options.router_init].format(std=config.initializer_range),
        ),
        ("Score scale factor", config.score_scale_factor),
        ("G-MoEfication compensation (mean output of skipped experts)", "on" if config.moe_compensation else "off"),
        ("Seed", options.seed),
        ("Weights dtype", str(config.dtype).replace("torch.", "")),
        ("Source", f"`{source.description}`"),
    ]
    note = method.card_note(options)
    if config.model_type == "attn_moe":  # attention-head experts (LLaMA-MoE v2), the MLP dense or MoE
        from .attention import card_note, card_settings

        settings = card_settings(config, settings)
        note = card_note(config) + (f" MLP: {note}" if config.moe_layers else "")
        data.tags.append("attention-moe")
    rows = "\n".join(f"| {name} | {value} |" for name, value in settings)
    body = f"""
# {Path(model_id).name}

A Mixture-of-Experts model converted from the dense {base_text} with
[llama-moe-hf](https://github.com/llama-moe-hf/llama-moe-hf) (LLaMA-MoE-style expert construction).

This checkpoint was converted, not trained. {note}

## Conversion

| Setting | Value |
|---|---|
{rows}

## Parameters

| | Parameters |
|---|---|
| Total | {total:,} ({_human(total)}) |
| Active per token | {active:,} ({_human(active)}) |

Active parameters count everything a token uses: embeddings, attention, norms, routers, shared experts and the
{config.num_experts_per_tok} routed experts it is sent to (of {config.num_experts}) in each MoE layer. Computed exactly
from the tensor shapes.

## Usage

With the package installed (`pip install llama-moe-hf`):

```python
import llama_moe_hf  # registers LlamaMoE with the transformers Auto classes
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{model_id}")
tokenizer = AutoTokenizer.from_pretrained("{model_id}")
messages = [{{"role": "user", "content": "What is the capital of France?"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=64, do_sample=False)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

Without the package, the modeling code stored next to the weights is used:

```python
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{model_id}", trust_remote_code=True)
```

Or from the command line: `llama-moe chat {model_id} --prompt "What is the capital of France?"`.

## Conversion record

Stored in `config.json` as `conversion_info`:

```json
{json.dumps(info, indent=2, sort_keys=True)}
```

## References

- LLaMA-MoE: Building Mixture-of-Experts from LLaMA with Continual Pre-training (Zhu et al., 2024), arXiv:2406.16554.
- Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints (Komatsuzaki et al., 2023), arXiv:2212.05055.
"""
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))


def write_model_card(folder: Path, config, options, source, total: int, active: int, model_id: str) -> Path:
    path = Path(folder) / "README.md"
    path.write_text(render_model_card(config, options, source, total, active, model_id), encoding="utf-8")
    return path

"""mergekit-moe's YAML (`mergekit-moe config.yaml OUT`) read as it is: its keys become a `MergeConfig`'s, each value
it spells its own way translated, and every key or value this merge cannot honour is one line of one error (nothing
is written). Our own merge recipe passes through unchanged (its keys are a superset).

    mergekit                                   here
    gate_mode: hidden | hidden_last            gate_mode: hidden, hidden_token: last
    gate_mode: hidden_avg                      gate_mode: hidden, hidden_token: mean
    architecture: mixtral | qwen | qwen3       architecture: mixtral | qwen2_moe | qwen3_moe
    source_model: org/name@revision            source_model: org/name, revision: revision
    shared_experts[0].positive_prompts         not used: the shared expert is always on (noted)
"""

import logging

logger = logging.getLogger(__name__)

GATE_MODES = {"hidden": ("hidden", "last"), "hidden_last": ("hidden", "last"), "hidden_avg": ("hidden", "mean")}
ARCHITECTURES = {"mixtral": "mixtral", "qwen": "qwen2_moe", "qwen2_moe": "qwen2_moe", "qwen3": "qwen3_moe"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}
UNSUPPORTED = {
    "deepseek": "architecture deepseek: write mixtral, qwen (qwen2_moe) or qwen3, or leave it out (llama_moe)",
    "tokenizer_source": "tokenizer_source: the base model's tokenizer is used",
    "tokenizer": "tokenizer: the base model's tokenizer is used",
    "modules": "modules: one base model only",
    "chat_template": "chat_template: the base model's chat template is used",
}


def from_mergekit(fields: dict, where: str) -> dict:
    """`fields` of a mergekit-moe (or our) YAML file as `config_from_dict` takes them; one ValueError listing, a line
    each, what it does not support."""
    fields, problems = dict(fields), []
    problems += [f"{key}: {why.split(': ', 1)[1]}" for key, why in UNSUPPORTED.items() if key in fields]
    for key in UNSUPPORTED:
        fields.pop(key, None)
    if fields.get("gate_mode") in GATE_MODES:
        fields["gate_mode"], fields["hidden_token"] = GATE_MODES[fields["gate_mode"]]
    architecture = fields.get("architecture")
    if architecture == "deepseek":
        problems.append(UNSUPPORTED["deepseek"])
    elif architecture in ARCHITECTURES:
        fields["architecture"] = ARCHITECTURES[architecture]
    if fields.get("architecture") is None:
        fields.pop("architecture", None)
    if isinstance(fields.get("dtype"), str):
        fields["dtype"] = DTYPES.get(fields["dtype"], fields["dtype"])
    for key in ("experts", "shared_experts"):
        if isinstance(fields.get(key), list):
            fields[key] = [_expert(entry, f"{key}[{i}]", key, problems) for i, entry in enumerate(fields[key])]
    if fields.get("base_model") is not None:
        fields["base_model"], revision = _reference(fields["base_model"], "base_model", problems)
        if revision:
            fields["base_revision"] = revision
    if problems:
        raise ValueError(f"{where} asks for what this merge does not support:\n  " + "\n  ".join(problems))
    return fields


def _expert(entry, where: str, key: str, problems: list) -> dict:
    if not isinstance(entry, dict):
        return entry  # config_from_dict names the mistake
    entry = dict(entry)
    if "source_model" in entry:
        entry["source_model"], revision = _reference(entry["source_model"], f"{where}.source_model", problems)
        if revision:
            entry["revision"] = revision
    if key == "shared_experts":
        for prompts in ("positive_prompts", "negative_prompts"):
            if entry.pop(prompts, None):
                logger.info(
                    "note: %s.%s not used: the shared expert is always on (no shared-expert gate).", where, prompts
                )
    return entry


def _reference(value, where: str, problems: list) -> tuple:
    """mergekit's model reference (`path`, `path@revision`, or `{model: {path, revision}}`) -> (path, revision)."""
    if isinstance(value, dict):
        model = value.get("model", value)
        if value.get("lora") or (isinstance(model, dict) and model.get("lora")):
            problems.append(f"{where}: LoRA references: merge the adapter into its model first")
        if isinstance(model, dict):
            return model.get("path"), model.get("revision")
        return model, value.get("revision")
    if isinstance(value, str) and "+" in value:
        problems.append(f"{where}: LoRA references ({value!r}): merge the adapter into its model first")
        return value, None
    if isinstance(value, str) and "@" in value:
        path, revision = value.rsplit("@", 1)
        return path, revision
    return value, None

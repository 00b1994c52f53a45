"""Greedy chat generation with a converted (or any local) model and its tokenizer's chat template."""

from pathlib import Path

import torch


def chat(model_path: str | Path, prompt: str, max_new_tokens: int = 64, dtype: torch.dtype = torch.float32) -> str:
    """Answer `prompt` as a single user turn with greedy decoding; returns the decoded answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..modeling import MODEL_FAMILIES  # noqa: F401  (registers the families: no remote code is run)

    path = Path(model_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model folder (no config.json).")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.chat_template is None:
        raise ValueError(f"The tokenizer in {path} has no chat template; `chat` needs an instruct model.")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()

"""Greedy chat generation with a converted (or any) model and its tokenizer's chat template."""

import sys

import torch


def chat(
    model: str,
    prompt: str,
    max_new_tokens: int = 64,
    dtype: str = "auto",
    stream: bool = False,
    device: str | None = None,
    download=None,
) -> str:
    """Answer `prompt` as a single user turn with greedy decoding; returns the decoded answer. `model` is a local
    folder, a Hub id or `default`; `dtype="auto"` computes in the checkpoint's dtype (float32 on a CPU without bf16 instructions); with `stream` the answer is
    also printed to stdout as it is generated."""
    from transformers import TextStreamer

    from .lm_head import use_threaded_lm_head
    from .loading import load_model

    loaded, tokenizer, folder = load_model(model, dtype=dtype, device=device, download=download)
    use_threaded_lm_head(loaded)  # batch-1 decoding on CPU in float32: the LM head on every thread
    if tokenizer.chat_template is None:
        raise ValueError(f"The tokenizer in {folder} has no chat template; `chat` needs an instruct model.")
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = inputs.to(loaded.device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with torch.inference_mode():
        output = loaded.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer)
    if stream:
        sys.stdout.flush()
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()

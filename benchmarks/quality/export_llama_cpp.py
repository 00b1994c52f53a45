"""The GGUF export run by llama.cpp: greedy tokens and logits against transformers, on the built-in SmolLM2.

    python benchmarks/quality/export_llama_cpp.py                      # upcycled 4 experts, top-2, float32
    python benchmarks/quality/export_llama_cpp.py --dtype bfloat16 --new-tokens 48
    python benchmarks/quality/export_llama_cpp.py --model outputs/presets/sparse-25   # a converted folder as it is

Converts SmolLM2-135M-Instruct by sparse upcycling (experts copied with a little noise, so that routing matters),
exports it with `llama-moe export --to gguf`, then, if llama-cpp-python (`llama_cpp`) is importable, runs the GGUF
in llama.cpp (float32 KV cache) and compares with the converted model in transformers: how llama.cpp tokenizes the
chat prompt, the prompt's logits, and the greedy continuation. Not part of CI.
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llama_moe.export import export_model
from llama_moe_hf import convert_to_moe

PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def chat_prompt(tokenizer) -> tuple[str, list[int]]:
    """PROMPT as the chat template writes it, ready for the answer: (text, token ids)."""
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    return text, tokenizer(text, add_special_tokens=False).input_ids


def llama_cpp_greedy(gguf_file: Path, prompt_ids: list[int], new_tokens: int, eos: int):
    """llama.cpp's prompt logits [P, V] and greedy continuation (argmax of its logits, no sampler)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(gguf_file),
        n_ctx=512,
        logits_all=True,
        verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32,  # the default F16 KV cache rounds keys and values
        type_v=llama_cpp.GGML_TYPE_F32,
    )
    llm.eval(prompt_ids)
    prompt_logits = np.array(llm.scores[: len(prompt_ids)])
    tokens = []
    for _ in range(new_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        if token == eos:
            break
        llm.eval([token])
    return llm, torch.tensor(prompt_logits), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--upcycle-noise", type=float, default=0.05)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, help="export this converted folder instead of upcycling")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        moe = (
            args.model
            or convert_to_moe(
                None,
                tmp / "moe",
                method="upcycle",
                num_experts=args.num_experts,
                top_k=args.top_k,
                upcycle_noise=args.upcycle_noise,
                progress=False,
            ).output_dir
        )
        start = time.perf_counter()
        result = export_model(moe, "gguf", tmp / "gguf", dtype=args.dtype, tokenizer_pre="smollm", progress=False)
        gguf_file = result.output_dir / result.files[0]
        print(f"export: {time.perf_counter() - start:.1f} s, {gguf_file.stat().st_size / 1e6:.0f} MB ({args.dtype})")
        for note in result.notes:
            print(f"note: {note}")
        compare(moe, gguf_file, args.new_tokens)


def compare(moe: Path, gguf_file: Path, new_tokens: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(moe)
    text, prompt_ids = chat_prompt(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = model(torch.tensor([prompt_ids])).logits[0]
        generated = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    hf_tokens = generated[0, len(prompt_ids) :].tolist()
    print(f"transformers (LlamaMoE): {tokenizer.decode(hf_tokens)!r}")
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        print(f"llama_cpp (llama-cpp-python) is not importable ({error}): llama.cpp comparison skipped.")
        return
    llm, cpp_logits, cpp_tokens = llama_cpp_greedy(gguf_file, prompt_ids, new_tokens, tokenizer.eos_token_id)
    cpp_prompt = llm.tokenize(text.encode(), add_bos=False, special=True)
    print(f"llama.cpp:               {tokenizer.decode(cpp_tokens)!r}")
    print(
        f"llama.cpp tokenizes the chat prompt like transformers: {cpp_prompt == prompt_ids} ({len(prompt_ids)} tokens)"
    )
    difference = (cpp_logits - hf_logits).abs().max().item()
    print(f"prompt logits, max |llama.cpp - transformers|: {difference:.2e} (logits up to {hf_logits.abs().max():.1f})")
    same = sum(a == b for a, b in zip(cpp_tokens, hf_tokens))
    print(f"greedy tokens identical: {cpp_tokens == hf_tokens} ({same} of {len(hf_tokens)} positions agree)")


if __name__ == "__main__":
    main()

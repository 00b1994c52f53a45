"""Run by test_generation.py in a fresh process: greedy generation of saved model folders in every cache mode.

    python generation_script.py [--remote-code] FOLDER...

With `--remote-code` this package cannot be imported, so only the code saved next to the weights runs (what a user
without the package gets); without it the installed package's classes load. Prints one JSON object: per folder, the
loaded class's module and the generated token ids of each mode, which the test compares with each other.
"""

import json
import sys


class BlockPackage:
    """A meta-path finder that refuses `llama_moe_hf` and `llama_moe`: only the folder's own code may run."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("llama_moe_hf", "llama_moe"):
            raise ImportError(f"{name} is blocked in this process")


def generations(model, tokens, pad_id: int = 0) -> dict[str, list]:
    """Greedy continuations of `tokens` (a list of prompts) in every cache mode, as lists of token ids."""
    import torch

    kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": pad_id}
    first = torch.tensor([tokens[0]])
    width = max(map(len, tokens))
    padded = torch.tensor([[pad_id] * (width - len(t)) + t for t in tokens])  # left padding
    mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in tokens])
    embeds = model.get_input_embeddings()(first)
    with torch.no_grad():
        runs = {
            "uncached": model.generate(first, use_cache=False, **kwargs),
            "dynamic": model.generate(first, **kwargs),
            "static": model.generate(first, cache_implementation="static", **kwargs),
            "padded_uncached": model.generate(padded, attention_mask=mask, use_cache=False, **kwargs),
            "padded_dynamic": model.generate(padded, attention_mask=mask, **kwargs),
            "padded_static": model.generate(padded, attention_mask=mask, cache_implementation="static", **kwargs),
            # From embeddings, generate returns only the new tokens.
            "embeds_uncached": model.generate(inputs_embeds=embeds, use_cache=False, **kwargs),
            "embeds_dynamic": model.generate(inputs_embeds=embeds, **kwargs),
        }
    return {mode: ids.tolist() for mode, ids in runs.items()}


def main(argv: list[str]) -> None:
    remote = argv[:1] == ["--remote-code"]
    if remote:
        sys.meta_path.insert(0, BlockPackage())
        argv = argv[1:]
    else:
        import llama_moe_hf  # noqa: F401  (registers the families: the installed classes win)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    tokens = json.loads(argv[0])
    results = {"transformers": transformers.__version__}
    for folder in argv[1:]:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote, dtype=torch.float32).eval()
        results[folder] = {"module": type(model).__module__, **generations(model, tokens)}
    assert not remote or not {"llama_moe_hf", "llama_moe"} & set(sys.modules)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])

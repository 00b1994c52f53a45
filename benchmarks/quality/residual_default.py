"""Why `--method residual --num-experts 7 --num-shared-experts 1 --top-k 1` was a trap, and what the default is now.

LLaMA-MoE v1 rescales a split's routed experts by N/k (8 experts top-2: 4x), because each of its experts is a random
eighth of the FFN and k of them stand in for all N. The residual split (LLaMA-MoE v2) took that default too, but there
an always-on shared expert carries the neurons that matter to every token and each routed expert the ones most
important to its own token group: multiplying the one routed expert by N/k = 7 adds six more copies of its output.
Held-out perplexity ratios on the first 4096 tokens of each text (`benchmarks/common.py`), all 30 layers of SmolLM2,
calibration on the default 8192 tokens of the built-in corpus, one thread:

    python benchmarks/quality/residual_default.py
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.common`

from benchmarks.common import heldout_tokens, perplexities
from llama_moe.checkpoints import default_model_path
from llama_moe.conversion.calibration import CalibrationContext
from llama_moe_hf import MoERecipe, build_moe

ROWS = {
    "before: k-means router, score scale N/k = 7": dict(score_scale_factor=7.0),
    "now: k-means router, score scale 1 (the default)": {},
    "k-means router, score scale 1, compensation": dict(compensation=True),
    "selector router, compensation": dict(router_init="selector", compensation=True),
}


def main() -> None:
    torch.set_num_threads(1)
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = {name: ids[:4096] for name, ids in heldout_tokens(tokenizer).items()}
    reference = perplexities(dense, tokens)
    context = CalibrationContext(MoERecipe(), lambda *_: dense, lambda: tokenizer, device="cpu")
    for label, extra in ROWS.items():
        fields = dict(method="residual", num_experts=7, num_shared_experts=1, top_k=1, **extra)
        result = perplexities(build_moe(dense, tokenizer=tokenizer, context=context, **fields), tokens)
        print(label, {name: round(result[name] / reference[name], 1) for name in result}, flush=True)


if __name__ == "__main__":
    main()

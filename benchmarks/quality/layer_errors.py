"""Each converted layer's reconstruction error: which layers a per-layer budget keeps dense.

Every MoE block of a converted folder gets the dense source's own MLP inputs on calibration tokens (the built-in
docstrings, as the presets calibrate); the error of its output against the dense MLP's, over the norm of the
residual stream after the layer (per token, averaged), ranks the layers.
`--average P` then keeps the layers with the largest errors dense, as many as make the FFN share active per token
average P over all layers with the others at the folder's share, and prints them as a `--moe-layers` value for
`llama-moe convert` (the layers to convert). Dense layers export through Qwen2-MoE's `mlp_only_layers`; GGUF takes
them only before the first MoE layer.

    python benchmarks/quality/layer_errors.py outputs/presets/sparse-25 --average 0.5
"""

import argparse
import json

import torch

from llama_moe.loading import load_model
from llama_moe.text.corpus import builtin_corpus


def active_share(config) -> float:
    """The share of the dense FFN's neurons one token runs through in a converted MoE layer."""
    shared = getattr(config, "num_shared_experts", 0) * (config.shared_expert_intermediate_size or 0)
    return (config.num_experts_per_tok * config.moe_intermediate_size + shared) / config.intermediate_size


def calibration_ids(tokenizer, tokens: int, window: int = 256) -> torch.Tensor:  # [tokens // window, window]
    texts, _ = builtin_corpus("docstrings")
    ids = tokenizer("\n\n".join(texts), return_tensors="pt").input_ids[0, : tokens - tokens % window]
    return ids.view(-1, window)


@torch.no_grad()
def layer_errors(dense, converted, input_ids: torch.Tensor) -> dict[int, dict[str, float]]:
    """Each converted layer's error on the dense model's MLP inputs x: `mlp`, ||moe(x) - mlp(x)|| / ||mlp(x)||, and
    `stream`, the same difference over the norm of the layer's output (the residual stream it perturbs), per token
    and averaged."""
    captured = {}

    def keep(name, i):
        return lambda module, args, output: captured.__setitem__((name, i), (args, output))

    hooks = [layer.mlp.register_forward_hook(keep("mlp", i)) for i, layer in enumerate(dense.model.layers)]
    hooks += [layer.register_forward_hook(keep("layer", i)) for i, layer in enumerate(dense.model.layers)]
    try:
        dense(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    errors = {}
    for i in converted.config.moe_layers:
        (x,), expected = captured[("mlp", i)]
        stream = captured[("layer", i)][1]
        difference = converted.model.layers[i].mlp(x) - expected  # [B, S, H]
        stream = stream[0] if isinstance(stream, tuple) else stream
        # per token: a few tokens' massive activations would otherwise set the whole stream's norm
        per_token = (difference.norm(dim=-1) / stream.norm(dim=-1)).mean()
        errors[i] = {"mlp": (difference.norm() / expected.norm()).item(), "stream": per_token.item()}
    return errors


def dense_layers_for(errors: dict[int, float], share: float, average: float, num_layers: int) -> list[int]:
    """The layers to keep dense (largest errors first) so that all layers average `average` of the FFN active."""
    count = round(num_layers * (average - share) / (1 - share))
    return sorted(sorted(errors, key=errors.get, reverse=True)[: max(count, 0)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a converted folder")
    parser.add_argument("--average", type=float, help="the FFN share active per token to reach over all layers")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dense, tokenizer, _ = load_model("default", dtype="float32", device="cpu")
    converted, _, _ = load_model(args.folder, dtype="float32", device="cpu")
    errors = layer_errors(dense, converted, calibration_ids(tokenizer, args.tokens))
    share = active_share(converted.config)
    print(json.dumps({"folder": args.folder, "active_share": round(share, 4), "errors": errors}))
    stream = {layer: error["stream"] for layer, error in errors.items()}
    for layer in sorted(stream, key=stream.get, reverse=True):
        print(f"layer {layer:2d}: {errors[layer]['stream']:.4f} of the stream, {errors[layer]['mlp']:.3f} of the MLP")
    if args.average is not None:  # ranked by the perturbation of the stream, which the next layers see
        keep = dense_layers_for(stream, share, args.average, dense.config.num_hidden_layers)
        convert = [layer for layer in converted.config.moe_layers if layer not in keep]
        print(f"dense layers for an average of {args.average:.0%}: {keep}")
        print("--moe-layers " + ",".join(map(str, convert)))


if __name__ == "__main__":
    main()

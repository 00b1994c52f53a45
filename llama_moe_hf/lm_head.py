"""The LM head on every CPU thread, for batch-1 decoding in float32 of any causal LM, dense or MoE.

At one token the LM head is a matrix-vector product over the whole vocabulary (SmolLM2: `[49152, 576]`, 113 MB a
step), and torch runs float32 matrix-vector products through MKL on one thread: 6.6 ms a step with 2 threads or 1,
eager or compiled. Two kernels use every thread instead (docs/benchmarks.md):
- in eager mode, oneDNN's inner product: 1.7 ms;
- under `torch.compile`, the product written as a multiply and a sum over the hidden size, which inductor turns into
  one reduction kernel that reads the weight once (as the experts' indexed reduction does): 2.4 ms.
That cuts the same time from the dense model and the MoE, so it raises the MoE's speed-up too (a 2/8 split: 1.42x to
1.53x dense in eager decoding, 1.78x to 1.98x compiled).

`use_threaded_lm_head(model)` replaces only the output embedding's `forward` (an instance attribute, as accelerate's
hooks do): the parameters, their tying to the input embedding, the state dict and `save_pretrained` are unchanged.
The oneDNN copy of the weight is built on first use and again whenever the parameter changes (its version counter
moves with every in-place update, such as an optimizer step). Anything else (autograd, more than one row when
compiled, another device or dtype, torch without oneDNN in eager mode) takes the plain `F.linear`, which is also the
reference the tests hold both kernels to.
"""

import functools

import torch
import torch.nn.functional as F


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available()


def use_threaded_lm_head(model) -> bool:
    """Run `model`'s output embedding (a `Linear`) on every thread when it runs on CPU in float32 without autograd.
    Returns whether it does (False: the head is not a `Linear`, or its `forward` is already wrapped by someone else,
    such as accelerate's offloading hooks, which it leaves alone). Undo: `restore_lm_head`."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return False
    wrapped = head.__dict__.get("forward")
    if wrapped is not None:
        return getattr(wrapped, "func", None) is _threaded_forward
    head.forward = functools.partial(_threaded_forward, head)
    return True


def restore_lm_head(model) -> None:
    """The output embedding's own `forward` again."""
    head = model.get_output_embeddings()
    head.__dict__.pop("forward", None)
    head.__dict__.pop("_onednn_weight", None)


def _threaded_forward(head: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """`head(hidden_states)` (`[..., H] -> [..., V]`): the reduction compiled, oneDNN in eager mode, else `F.linear`."""
    weight, bias = head.weight, head.bias
    plain = (
        hidden_states.device.type != "cpu"
        or hidden_states.dtype != torch.float32
        or weight.dtype != torch.float32
        or (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
    )
    if plain:
        return F.linear(hidden_states, weight, bias)
    if torch.compiler.is_compiling():
        if hidden_states.numel() != hidden_states.shape[-1]:
            return F.linear(hidden_states, weight, bias)
        # One row: inductor turns the product and sum into one reduction kernel on every thread, reading the weight
        # once (its matrix-vector call runs on one thread), as the experts' indexed reduction does.
        output = (hidden_states.unsqueeze(-2) * weight).sum(-1)
        return output if bias is None else output + bias
    if not onednn_available():
        return F.linear(hidden_states, weight, bias)
    key = (weight.data_ptr(), weight._version, None if bias is None else (bias.data_ptr(), bias._version))
    cached = head.__dict__.get("_onednn_weight")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            dnn_bias = None if bias is None else bias.detach().to_mkldnn()
            cached = head.__dict__["_onednn_weight"] = (key, weight.detach().to_mkldnn(), dnn_bias)
    output = torch.ops.aten.mkldnn_linear(hidden_states.contiguous().to_mkldnn(), cached[1], cached[2])
    return output.to_dense()

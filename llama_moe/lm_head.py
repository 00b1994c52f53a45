"""Linear layers on every CPU thread, for batch-1 decoding in float32 of any causal LM, dense or MoE.

At one token a linear layer is a matrix-vector product, and torch runs float32 matrix-vector products through MKL on
one thread, eager or compiled; the LM head is the largest of them. Two kernels use every thread instead (timings:
benchmarks/reports/cpu-decoding.md, "Decoding and prefill of the default model"):
- in eager mode, oneDNN's inner product (only for the head: at the size of the other layers its per-call cost
  outweighs the second thread, so they keep `F.linear`);
- under `torch.compile`, the product written as a multiply and a sum over the hidden size, which inductor turns into
  one reduction kernel that reads the weight once (as the experts' indexed reduction does).

`use_threaded_lm_head(model)` threads the output embedding, eager and compiled (what `llama-moe chat` uses);
`use_threaded_linears(model)` also every other `Linear` under `torch.compile`. Each replaces only a module's `forward` (an instance attribute, as
accelerate's hooks do): the parameters, their tying to the input embedding, the state dict and `save_pretrained` are
unchanged.
The oneDNN copy of the head's weight is built on first use and again whenever the parameter changes (its version
counter moves with every in-place update, such as an optimizer step). Anything else (autograd, more than one row when
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
    return isinstance(head, torch.nn.Linear) and _wrap(head, _threaded_forward)


def use_threaded_linears(model) -> int:
    """`use_threaded_lm_head`, and under `torch.compile` every other `Linear` of `model` too (attention projections,
    dense MLPs, shared experts), one row at a time, as the same reduction: compiled, torch still
    runs their float32 matrix-vector products on one thread. In eager mode they keep `F.linear`: at these sizes
    oneDNN's per-call cost outweighs the second thread (benchmarks/reports/cpu-decoding.md). Returns how many
    `Linear`s run so (the head included); undo: `restore_lm_head`."""
    wrapped = int(use_threaded_lm_head(model))
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            wrapped += _wrap(module, _compiled_row_forward)
    return wrapped


def restore_lm_head(model) -> None:
    """Every `Linear` of `model` runs its own `forward` again (undoes both `use_threaded_*`)."""
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "func", None) in (_threaded_forward, _compiled_row_forward):
            module.__dict__.pop("forward")
            module.__dict__.pop("_onednn_weight", None)


def _wrap(module: torch.nn.Linear, forward) -> bool:
    """Whether `module` runs `forward` now: set as an instance attribute, unless someone else's wrapper is there."""
    wrapped = module.__dict__.get("forward")
    if wrapped is not None:
        return getattr(wrapped, "func", None) is forward
    module.forward = functools.partial(forward, module)
    return True


def _needs_plain(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    """Another device or dtype, or autograd: `F.linear`, the reference both kernels are held to."""
    return (
        hidden_states.device.type != "cpu"
        or hidden_states.dtype != torch.float32
        or weight.dtype != torch.float32
        or (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
    )


def _row_reduction(linear: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """One row: inductor turns the product and sum into one reduction kernel on every thread, reading the weight once
    (its matrix-vector call runs on one thread), as the experts' indexed reduction does. Compiled only: in eager mode
    the product would be materialised."""
    output = (hidden_states.unsqueeze(-2) * linear.weight).sum(-1)
    return output if linear.bias is None else output + linear.bias


def _compiled_row_forward(linear: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """`linear(hidden_states)`: the reduction when compiled at one row, else `F.linear`."""
    one_row = hidden_states.numel() == hidden_states.shape[-1]
    if one_row and torch.compiler.is_compiling() and not _needs_plain(hidden_states, linear.weight):
        return _row_reduction(linear, hidden_states)
    return F.linear(hidden_states, linear.weight, linear.bias)


def _threaded_forward(head: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """`head(hidden_states)` (`[..., H] -> [..., V]`): the reduction compiled, oneDNN in eager mode, else `F.linear`."""
    weight, bias = head.weight, head.bias
    if torch.compiler.is_compiling() or _needs_plain(hidden_states, weight) or not onednn_available():
        return _compiled_row_forward(head, hidden_states)
    key = (weight.data_ptr(), weight._version, None if bias is None else (bias.data_ptr(), bias._version))
    cached = head.__dict__.get("_onednn_weight")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            dnn_bias = None if bias is None else bias.detach().to_mkldnn()
            cached = head.__dict__["_onednn_weight"] = (key, weight.detach().to_mkldnn(), dnn_bias)
    output = torch.ops.aten.mkldnn_linear(hidden_states.contiguous().to_mkldnn(), cached[1], cached[2])
    return output.to_dense()

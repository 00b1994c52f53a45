"""SoapMoE's merged-experts FFN as a hand-written autograd Function (`SegmentMergedFFN`): each row (a segment of
tokens) runs through its own routing-weighted merge of the experts, a chunk of rows at a time, with the merged
weights merged again in backward instead of kept, so memory grows with the chunk, not with the number of segments
(docs/soap.md, "What the code does").

This file is copied next to saved checkpoints (remote code): it imports only torch.
"""

import torch
import torch.nn.functional as F


def merge_experts(weights: torch.Tensor, index: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """sum_j weights[n, j] * experts[index[n, j]] for each row n: [N, k], [N, k], [E, *shape] -> [N, *shape].
    All experts in order (k == E): one [N, E] @ [E, P] matmul; top-k: gather the k experts, then a batched matmul."""
    flat = experts.reshape(experts.shape[0], -1)  # [E, P]
    weights = weights.to(flat.dtype)
    if index.shape[-1] == flat.shape[0]:
        merged = weights @ flat
    else:
        merged = torch.bmm(weights.unsqueeze(1), flat[index]).squeeze(1)  # [N, 1, k] @ [N, k, P]
    return merged.view(weights.shape[0], *experts.shape[1:])


def _merge_backward(grad_merged, weights, index, experts, grad_experts, first: bool) -> torch.Tensor:
    """Backward of `merge_experts`: the gradient of its weights [N, k] is returned, that of the experts written
    (`first`) or added into `grad_experts` [E, P] in place (no [E, P] temporary, no zero fill), given the merged
    rows' gradient [N, *shape]."""
    flat, grad = experts.reshape(experts.shape[0], -1), grad_merged.reshape(grad_merged.shape[0], -1)
    weights = weights.to(grad.dtype)
    if index.shape[-1] == flat.shape[0]:
        if first:
            torch.mm(weights.T, grad, out=grad_experts)
        else:
            grad_experts.addmm_(weights.T, grad)
        return grad @ flat.T
    if first:
        grad_experts.zero_()
    rows = (weights.unsqueeze(-1) * grad.unsqueeze(1)).flatten(0, 1)  # [N * k, P]
    grad_experts.index_add_(0, index.flatten(), rows)
    return torch.bmm(flat[index], grad.unsqueeze(-1)).squeeze(-1)  # [N, k, P] @ [N, P, 1]


def _weight_grads(grad: torch.Tensor, inputs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """grad[n]^T @ inputs[n] per row into `out`: [N, L, O], [N, L, I] -> [N, O, I]."""
    return torch.bmm(grad.transpose(1, 2), inputs, out=out)


def _swiglu_backward(pre: torch.Tensor, grad_hidden: torch.Tensor, act_fn, silu: bool) -> torch.Tensor:
    """Gradient of `act_fn(gate) * up` with respect to pre = [gate | up] [n, L, 2I], given that of the product
    [n, L, I]. SiLU: written straight into the two halves of one buffer (aten's fused `silu_backward`), with no
    autograd graph and no `cat`; any other activation through autograd."""
    gate, up = pre.chunk(2, dim=-1)
    if not silu:
        gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
        with torch.enable_grad():
            hidden = act_fn(gate) * up
        return torch.cat(torch.autograd.grad(hidden, (gate, up), grad_hidden), dim=-1)
    grad_pre = torch.empty_like(pre)
    grad_gate, grad_up = grad_pre.chunk(2, dim=-1)
    torch.mul(grad_hidden, up, out=grad_up)  # d(silu(gate)), parked in the up half until the gate's is written
    torch.ops.aten.silu_backward.grad_input(grad_up, gate, grad_input=grad_gate)
    torch.mul(F.silu(gate), grad_hidden, out=grad_up)
    return grad_pre


def _overwritable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s memory under a version counter of its own: backward writes gradients over the merged weights it
    saved without autograd's in-place check refusing a second backward (which, told so, merges again)."""
    return tensor.new_empty(0).set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _chunks(rows: int, size: int):
    return (slice(start, min(start + size, rows)) for start in range(0, rows, size))


class SegmentMergedFFN(torch.autograd.Function):
    """y[n] = SwiGLU(x[n]) with row n's merged weights, `chunk` rows at a time. At most one chunk of merged weights
    exists at once: when there are several chunks, backward merges each again instead of keeping all N (memory
    O(chunk), not O(N)); a single chunk is kept from the forward. Saved for backward: the input, the pre-activations
    and the activation product (what the weight gradients read), nothing of autograd's own."""

    @staticmethod
    def forward(ctx, x, weights, index, gate_up_proj, down_proj, act_fn, chunk, silu=False):
        # x [N, L, H]; weights, index [N, k]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]
        output = torch.empty_like(x)
        pre_activation = x.new_empty(*x.shape[:2], gate_up_proj.shape[1])  # [N, L, 2I]
        hidden = x.new_empty(*x.shape[:2], down_proj.shape[2])  # [N, L, I]
        for rows in _chunks(x.shape[0], chunk):
            gate_up = merge_experts(weights[rows], index[rows], gate_up_proj)  # [n, 2I, H]
            down = merge_experts(weights[rows], index[rows], down_proj)  # [n, H, I]
            torch.bmm(x[rows], gate_up.transpose(1, 2), out=pre_activation[rows])
            gate, up = pre_activation[rows].chunk(2, dim=-1)
            torch.mul(act_fn(gate), up, out=hidden[rows])
            torch.bmm(hidden[rows], down.transpose(1, 2), out=output[rows])
        kept = (gate_up, down) if x.shape[0] <= chunk else ()
        ctx.save_for_backward(x, weights, index, gate_up_proj, down_proj, pre_activation, hidden, *kept)
        ctx.act_fn, ctx.chunk, ctx.silu, ctx.kept_overwritten = act_fn, chunk, silu, False
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, weights, index, gate_up_proj, down_proj, pre_activation, hidden, *kept = ctx.saved_tensors
        kept = () if ctx.kept_overwritten else [_overwritable(t) for t in kept]  # later backwards merge again
        ctx.kept_overwritten = True
        grad_x, grad_weights = torch.empty_like(x), torch.empty_like(weights)
        grad_gate_up, grad_down = torch.empty_like(gate_up_proj), torch.empty_like(down_proj)
        for number, rows in enumerate(_chunks(x.shape[0], ctx.chunk)):
            gate_up, down = kept or [merge_experts(weights[rows], index[rows], p) for p in (gate_up_proj, down_proj)]
            grad_hidden = torch.bmm(grad_output[rows], down)  # [n, L, I]
            # Each merged weight's gradient is written over the merged weight once it has been read for the last
            # time: no fresh [n, *merged] buffers (memory, and on CPU their page faults).
            grad_down_merged = _weight_grads(grad_output[rows], hidden[rows], out=down)  # [n, H, I]
            grad_pre = _swiglu_backward(pre_activation[rows], grad_hidden, ctx.act_fn, ctx.silu)  # [n, L, 2I]
            torch.bmm(grad_pre, gate_up, out=grad_x[rows])
            grad_gate_up_merged = _weight_grads(grad_pre, x[rows], out=gate_up)  # [n, 2I, H]
            merged_grads = ((grad_gate_up_merged, gate_up_proj, grad_gate_up), (grad_down_merged, down_proj, grad_down))
            grad_weights[rows] = sum(
                _merge_backward(grad, weights[rows], index[rows], experts, total.view(len(experts), -1), number == 0)
                for grad, experts, total in merged_grads
            ).to(grad_weights.dtype)
        return grad_x, grad_weights, None, grad_gate_up, grad_down, None, None, None

"""The routed experts' computation, apart from the families that use it (as transformers keeps its own in
`integrations/moe.py`): the fused-experts base class, the SwiGLU helpers, and the experts implementations registered
with transformers' experts interface (`ALL_EXPERTS_FUNCTIONS`) next to its `grouped_mm` and `batched_mm`:

    llama_moe_cpu           the fastest of three dispatches on CPU for the number of (token, expert) rows
    llama_moe_cpu_compiled  llama_moe_auto, with decoding steps on CPU run by a kernel compiled by inductor
    llama_moe_auto          the default: llama_moe_cpu on CPU, transformers' kernels elsewhere

benchmarks/reports/moe-layer-speed.md ("MoE layer forward speed", "What the default path does (and why)") and
benchmarks/reports/cpu-decoding.md ("Compiled decoding") have the measurements behind the dispatch thresholds.

This file is copied next to saved checkpoints (remote code): it imports only torch and transformers.
"""

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    batched_mm_experts_forward,
    grouped_mm_experts_forward,
)
from transformers.utils.import_utils import is_torchdynamo_compiling

# `llama_moe_cpu`: while no expert gets more than BMM_MAX_ROWS_PER_EXPERT (token, expert) rows and the padded layout
# holds at most BMM_MAX_PADDED_ROWS, one batched matmul over zero-padded per-expert rows beats a loop of small
# per-expert matmuls on CPU; beyond, its speed depends on the process (benchmarks/reports/moe-layer-speed.md).
BMM_MAX_ROWS_PER_EXPERT = 128
BMM_MAX_PADDED_ROWS = 1024


def swiglu(gate_up: torch.Tensor, act_fn) -> torch.Tensor:
    """`act_fn(gate) * up` of fused `[..., 2m]` pre-activations, gate first: `[..., m]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up


def swiglu_linear(states: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn) -> torch.Tensor:
    """One SwiGLU FFN (`gate_up [2m, H]`, `down [H, m]`) on `[n, H]` rows: `[n, H]`."""
    return F.linear(swiglu(F.linear(states, gate_up), act_fn), down)


def swiglu_bmm(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn) -> torch.Tensor:
    """N SwiGLU FFNs at once (`gate_up [N, 2m, H]`, `down [N, H, m]`), FFN n on `rows[n]` (`[N, L, H]`): `[N, L, H]`."""
    return torch.bmm(swiglu(torch.bmm(rows, gate_up.transpose(1, 2)), act_fn), down.transpose(1, 2))


class FusedExperts(nn.Module):
    """E SwiGLU experts as fused 3-D tensors: `gate_up_proj [E, 2m, H]` (gate rows first), `down_proj [E, H, m]`
    (transformers' MoE layout). LlamaMoE's routed experts and SoapMoE's merged experts both build on it."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    def expert(self, states: torch.Tensor, expert_idx: int) -> torch.Tensor:
        """SwiGLU of one expert on `[n, H]` rows, through views of the fused weights (no copy)."""
        return swiglu_linear(states, self.gate_up_proj[expert_idx], self.down_proj[expert_idx], self.act_fn)


def expert_one_hot(index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[..., k, E]` bool: whether each entry of `index` (`[..., k]` expert ids) is expert e. A comparison rather than
    a scatter: one pointwise op, which inductor fuses into the ops that read it."""
    return index[..., None] == torch.arange(num_experts, device=index.device)


def padded_experts_forward(
    experts: FusedExperts,
    hidden_states: torch.Tensor,  # [T, H]
    row_token: torch.Tensor,  # [E * C]: the token of each padded row, expert e's rows at [e * C, (e + 1) * C)
    row_weight: torch.Tensor,  # [E * C, 1], in the dtype of hidden_states
) -> torch.Tensor:
    """`[T, H]`: every expert on its C rows at once, with fixed shapes: one gather into `[E, C, H]`, one `bmm` per
    projection, one `index_add_` of the weighted rows back. A padding row (weight 0) adds nothing."""
    padded = hidden_states.index_select(0, row_token).view(experts.num_experts, -1, hidden_states.shape[-1])
    expert_output = swiglu_bmm(padded, experts.gate_up_proj, experts.down_proj, experts.act_fn)  # [E, C, H]
    output = torch.zeros_like(hidden_states)
    return output.index_add_(0, row_token, expert_output.view(row_token.numel(), -1) * row_weight)


def _decode_token(experts: FusedExperts, state: torch.Tensor, ids: list[int], weights: torch.Tensor) -> torch.Tensor:
    """`[H]`: one token's weighted sum over its experts `ids` (`weights [k]`), matrix-vector products on views of the
    fused weights. The fewest kernels: the k gate_up products are stacked once so that the activation and the
    weighting run once for all k, and the down products accumulate (`addmv`) instead of being stacked and summed."""
    gate_up = torch.stack([torch.mv(experts.gate_up_proj[e], state) for e in ids])  # [k, 2m]
    activations = swiglu(gate_up, experts.act_fn) * weights[:, None]  # [k, m]
    output = torch.mv(experts.down_proj[ids[0]], activations[0])  # [H]
    for expert_idx, activation in zip(ids[1:], activations[1:]):
        output = torch.addmv(output, experts.down_proj[expert_idx], activation)
    return output


def llama_moe_cpu_experts_forward(
    self: FusedExperts,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """`experts_implementation="llama_moe_cpu"`: the fastest of three dispatches for the number of rows.

    - decoding (`T * k <= E`): the selected experts run one by one on views of the fused weights; no sort or scatter;
    - short prompts (at most `BMM_MAX_ROWS_PER_EXPERT` rows per expert, `BMM_MAX_PADDED_ROWS` in all): one batched
      matmul per projection over expert rows zero-padded to the largest count (`padded_experts_forward`);
    - long inputs: each expert gathers only its own rows (a cache-sized working set) and adds its output back.
    Device-agnostic and autograd-friendly. The scatter is `index_add_`, which
    `torch.use_deterministic_algorithms(True)` makes deterministic on CUDA as well.
    """
    weights = top_k_weights.to(hidden_states.dtype)
    if top_k_index.numel() <= self.num_experts:
        # Matrix-vector products on views of the selected experts' weights: the fewest ops per expert, which is what
        # a decoding step costs here (the weights are read once either way).
        rows = [
            _decode_token(self, hidden_states[token_idx], ids, weights[token_idx])
            for token_idx, ids in enumerate(top_k_index.tolist())
        ]  # T x [H]
        return rows[0][None] if len(rows) == 1 else torch.stack(rows)  # one token: a view, not one more copy

    # Group the S = T*k (token, expert) pairs by expert with one sort and a single host sync (the counts).
    top_k = top_k_index.shape[-1]
    sorted_experts, order = top_k_index.reshape(-1).sort()  # [S] each
    counts = torch.bincount(sorted_experts, minlength=self.num_experts)  # [E]
    counts_list = counts.tolist()
    token_index = order // top_k  # [S]
    sorted_weights = weights.reshape(-1, 1).index_select(0, order)  # [S, 1]

    capacity = max(counts_list)
    if capacity <= BMM_MAX_ROWS_PER_EXPERT and capacity * self.num_experts <= BMM_MAX_PADDED_ROWS:
        # Expert e's rows fill rows [e * C, (e + 1) * C) of a padded layout, C = the largest count. Padding rows
        # repeat token 0 with weight 0.
        first_of_expert = counts.cumsum(0) - counts  # [E]
        slot = torch.arange(order.numel(), device=order.device) - first_of_expert[sorted_experts]  # [S]
        padded_rows = sorted_experts * capacity + slot  # [S]
        row_token = token_index.new_zeros(self.num_experts * capacity).index_copy_(0, padded_rows, token_index)
        row_weight = weights.new_zeros(self.num_experts * capacity, 1).index_copy(0, padded_rows, sorted_weights)
        return padded_experts_forward(self, hidden_states, row_token, row_weight)

    output = torch.zeros_like(hidden_states)  # [T, H]
    # Views through one unbind: its backward stacks the experts' gradients once, where indexing each expert would
    # add a zero-filled gradient of all E experts per expert (5x the forward's time in training on Llama-3-8B's shape)
    gate_ups, downs = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
    start = 0
    for expert_idx, count in enumerate(counts_list):
        if count:
            tokens = token_index[start : start + count]  # [n]
            rows = hidden_states.index_select(0, tokens)
            expert_output = swiglu_linear(rows, gate_ups[expert_idx], downs[expert_idx], self.act_fn)  # [n, H]
            output.index_add_(0, tokens, expert_output * sorted_weights[start : start + count])
            start += count
    return output


# ---------------------------------------------------------------------------------------------------------------
# Indexed reductions: the decoding kernels that run compiled
# ---------------------------------------------------------------------------------------------------------------


def indexed_reduction(
    gate_up_proj: torch.Tensor,  # [E, 2m, H]
    down_proj: torch.Tensor,  # [E, H, m]
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
    act_fn,
) -> torch.Tensor:
    """`[T, H]`: each projection as a product and a sum over the selected experts' weights, indexed where they lie.
    Inductor turns the indexing into loads inside one reduction kernel on every thread, so the selected weights are
    read once and never copied (`grouped_mm` first gathers them into a new tensor, and decoding is bound by weight
    reads). In eager mode the indexing would copy: run it compiled only."""
    gate_up = (gate_up_proj[top_k_index] * hidden_states[:, None, None, :]).sum(-1)  # [T, k, 2m]
    expert_output = (down_proj[top_k_index] * swiglu(gate_up, act_fn)[:, :, None, :]).sum(-1)  # [T, k, H]
    return (expert_output * top_k_weights.to(expert_output.dtype)[..., None]).sum(1)  # [T, H]


def indexed_reduction_experts_forward(self: FusedExperts, hidden_states, top_k_index, top_k_weights):
    """Few (token, expert) pairs under `torch.compile` (`indexed_reduction`)."""
    return indexed_reduction(self.gate_up_proj, self.down_proj, hidden_states, top_k_index, top_k_weights, self.act_fn)


def silu_indexed_reduction(gate_up_proj, down_proj, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """`indexed_reduction` with SiLU: a function of its own, because Dynamo keeps its compiled graphs (and their limit
    of 8) per code object, which every compiled `functools.partial` shares."""
    return indexed_reduction(gate_up_proj, down_proj, hidden_states, top_k_index, top_k_weights, F.silu)


def silu_mlp_reduction(gate_proj, up_proj, down_proj, hidden_states) -> torch.Tensor:
    """`[T, H]`: a SwiGLU MLP (`gate_proj`, `up_proj` `[m, H]`, `down_proj` `[H, m]`) as products and sums, which
    inductor runs on every thread: `llama_moe_cpu_compiled`'s kernel for the shared experts."""
    states = hidden_states[:, None, :]  # [T, 1, H]
    hidden = F.silu((gate_proj * states).sum(-1)) * (up_proj * states).sum(-1)  # [T, m]
    return (down_proj * hidden[:, None, :]).sum(-1)  # [T, H]


@functools.cache
def compiled(kernel):
    """`kernel` compiled by inductor on first use: `llama_moe_cpu_compiled`'s eager-mode decoding kernels
    (`silu_indexed_reduction` for the routed experts, `silu_mlp_reduction` for the shared ones)."""
    return torch.compile(kernel, fullgraph=True)


_SILU_TYPES = (nn.SiLU, type(ACT2FN["silu"]))  # "silu" and "swish"
_COMPILE_FAILED: list[str] = []  # why compiling a decoding kernel failed in this process, once it has


def compiled_decoding_applies(config, hidden_states: torch.Tensor, act_fn) -> bool:
    """Whether `llama_moe_cpu_compiled` runs a compiled kernel for `hidden_states` (`[T, H]`): chosen in `config`,
    decoding-sized (`T * k <= E` (token, expert) pairs), eager mode on CPU without autograd, SiLU, and no compile has
    failed in this process."""
    return (
        getattr(config, "_experts_implementation", None) == "llama_moe_cpu_compiled"
        and hidden_states.shape[0] * config.num_experts_per_tok <= config.num_experts
        and hidden_states.is_cpu
        and not torch.is_grad_enabled()
        and not is_torchdynamo_compiling()
        and isinstance(act_fn, _SILU_TYPES)
        and not _COMPILE_FAILED
    )


def run_compiled(kernel, *inputs: torch.Tensor) -> torch.Tensor | None:
    """`compiled(kernel)(*inputs)` (the weights among `inputs` detached: plain inputs, so no guard on requires_grad
    and shapes that may become dynamic), or None where it did not run: past Dynamo's recompile limit (for this call),
    or when compiling failed (said once; no compiled kernel runs in this process from then on)."""
    try:
        return compiled(kernel)(*inputs)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        return None
    except Exception as error:  # noqa: BLE001 - inductor fails in many ways; the eager path is exact
        _COMPILE_FAILED.append(f"{type(error).__name__}: {str(error).strip()[:200]}")
        message = "llama_moe_cpu_compiled could not compile its decoding kernel, so it runs llama_moe_cpu: "
        warnings.warn(message + _COMPILE_FAILED[0], stacklevel=3)
        return None


def compiled_shared_experts(shared, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """`llama_moe_cpu_compiled`'s kernel for a SwiGLU MLP of plain `gate_proj`, `up_proj`, `down_proj` layers (the
    shared experts) where it applies (`compiled_decoding_applies`), else None. Plain layers only: an adapter's (LoRA)
    weights are not in `.weight`."""
    projections = (shared.gate_proj, shared.up_proj, shared.down_proj)
    if not compiled_decoding_applies(shared.config, hidden_states, shared.act_fn):
        return None
    if not all(type(p) is nn.Linear for p in projections):
        return None
    return run_compiled(silu_mlp_reduction, *(p.weight.detach() for p in projections), hidden_states)


# ---------------------------------------------------------------------------------------------------------------
# The implementations registered with transformers
# ---------------------------------------------------------------------------------------------------------------


def llama_moe_cpu_compiled_experts_forward(self: FusedExperts, hidden_states, top_k_index, top_k_weights):
    """`experts_implementation="llama_moe_cpu_compiled"`: `llama_moe_auto`, except that decoding-sized inputs (`T * k
    <= E`) in eager mode on CPU without autograd (SiLU experts, no expert parallelism) run `indexed_reduction`
    compiled by inductor, and so do the shared experts (`silu_mlp_reduction`): every thread reads the weights, where
    `torch.mv` uses one. Compiling takes seconds, once per process and per dtype and input shape class, so it is not
    the default. Where inductor cannot compile (no C++ compiler) it says so once and runs `llama_moe_cpu` from then
    on; a variant beyond Dynamo's recompile limit runs `llama_moe_cpu` alone."""
    output = None
    if not self._is_expert_parallel and compiled_decoding_applies(self.config, hidden_states, self.act_fn):
        weights = (self.gate_up_proj.detach(), self.down_proj.detach())
        output = run_compiled(silu_indexed_reduction, *weights, hidden_states, top_k_index, top_k_weights)
    if output is None:
        output = llama_moe_auto_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return output


def llama_moe_auto_experts_forward(self: FusedExperts, hidden_states, top_k_index, top_k_weights):
    """`experts_implementation="llama_moe_auto"` (the default): `llama_moe_cpu` on CPU; compiled on CPU, the indexed
    reduction for decoding-sized inputs (`T * k <= E`); otherwise, under `torch.compile` (which needs shapes that do
    not depend on the routing) and with expert parallelism (whose dispatch marks the tokens of other ranks' experts),
    transformers' `grouped_mm`, the default of its own MoE families; eager on a GPU, decoding-sized inputs take
    `batched_mm`, as transformers' `generate` switches its own MoE models to for decoding there (batch-1 decoding of
    a small model is bound by kernel launches)."""
    if self._is_expert_parallel:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    on_cpu = hidden_states.device.type == "cpu"
    compiling, decoding = is_torchdynamo_compiling(), top_k_index.numel() <= self.num_experts
    if on_cpu and not compiling:
        return llama_moe_cpu_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if on_cpu and decoding:
        return indexed_reduction_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if decoding and not compiling:
        return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


ALL_EXPERTS_FUNCTIONS.register("llama_moe_cpu", llama_moe_cpu_experts_forward)
ALL_EXPERTS_FUNCTIONS.register("llama_moe_cpu_compiled", llama_moe_cpu_compiled_experts_forward)
ALL_EXPERTS_FUNCTIONS.register("llama_moe_auto", llama_moe_auto_experts_forward)

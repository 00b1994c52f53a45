"""Training-free attention routers (`--attn-router-init fit`): a ridge regression from the attention input to each
attention expert's output norm on calibration text, so that a router prefers the experts that contribute most.

The calibration pass accumulates, per attention-MoE layer, the normal equations of the regression
(`AttentionFitAccumulator`); `fit_attention_router` solves them. Memory does not grow with the number of tokens.
"""

from dataclasses import dataclass

import torch


def expert_output_norms(
    head_outputs: torch.Tensor,  # [N, heads * head_dim], the input of o_proj
    o_proj_weight: torch.Tensor,  # [H, heads * head_dim]
    num_experts: int,
) -> torch.Tensor:
    """`[N, E]`: L2 norm of each expert's contribution to the attention output, ||o_proj[:, heads_e] @ heads_e(x)||."""
    num_tokens = head_outputs.shape[0]
    per_expert = head_outputs.float().view(num_tokens, num_experts, -1)  # [N, E, n*D]
    weight = o_proj_weight.float().view(o_proj_weight.shape[0], num_experts, -1)  # [H, E, n*D]
    return torch.einsum("ned,hed->neh", per_expert, weight).norm(dim=-1)


@dataclass
class AttentionCalibration:
    """Normal equations of one layer's router regression: `gram = X^T X` `[H, H]`, `cross = X^T Y` `[H, E]` (float64),
    over `count` tokens; X the attention inputs, Y the expert output norms centred per token."""

    gram: torch.Tensor
    cross: torch.Tensor
    count: int


class AttentionFitAccumulator:
    """Hooks on one dense attention block: its input (after input_layernorm) and the input of its o_proj."""

    def __init__(self, attention: torch.nn.Module, num_experts: int):
        hidden_size = attention.o_proj.out_features
        self.num_experts = num_experts
        self.stats = AttentionCalibration(
            torch.zeros(hidden_size, hidden_size, dtype=torch.float64),
            torch.zeros(hidden_size, num_experts, dtype=torch.float64),
            0,
        )
        self._input = None
        self.handles = [
            attention.register_forward_pre_hook(self._save_input, with_kwargs=True),
            attention.o_proj.register_forward_pre_hook(self._accumulate),
        ]

    def _save_input(self, module, args, kwargs):
        self._input = kwargs.get("hidden_states", args[0] if args else None)

    def _accumulate(self, o_proj, args):
        x = self._input.detach().reshape(-1, self._input.shape[-1]).double()  # [N, H]
        norms = expert_output_norms(args[0].detach().reshape(x.shape[0], -1), o_proj.weight, self.num_experts)
        target = norms.double() - norms.double().mean(dim=1, keepdim=True)  # only the ranking within a token matters
        self.stats.gram += (x.T @ x).cpu()
        self.stats.cross += (x.T @ target).cpu()
        self.stats.count += x.shape[0]
        self._input = None

    def result(self) -> AttentionCalibration:
        return self.stats

    def remove(self):
        for handle in self.handles:
            handle.remove()


def fit_attention_router(stats: AttentionCalibration, ridge: float = 1e-2, logit_std: float = 0.1) -> torch.Tensor:
    """Router weight `W [E, H]` (float32) such that `x W^T` predicts each expert's output norm.

    Ridge regression with `ridge` times the mean diagonal of the Gram matrix. The ranking of the logits is what
    selects experts; the weights are scaled so that the logits have standard deviation `logit_std` on the calibration
    data, which keeps the top-k weights close to uniform (with `attention_score_scale_factor = k` the kept experts
    get weight about 1, as in the dense model).
    """
    hidden_size, num_experts = stats.cross.shape
    regulariser = ridge * stats.gram.diagonal().mean() * torch.eye(hidden_size, dtype=torch.float64)
    weight = torch.linalg.solve(stats.gram + regulariser, stats.cross).T  # [E, H]
    # Logit spread on the calibration data: sqrt(mean over experts of w_e^T (X^T X / N) w_e).
    spread = torch.sqrt(torch.einsum("eh,hk,ek->", weight, stats.gram / max(stats.count, 1), weight) / num_experts)
    return (weight * (logit_std / spread.clamp_min(1e-12))).float()

"""The distillation loss both healing in the conversion (`conversion.healing.joint`) and training
(`training.distill`) use: the per-position KL from the teacher's next-token distribution to the student's, and its
weighting against the student's own loss."""

import torch
import torch.nn.functional as F


def distillation_kl(student_logits, teacher_logits, temperature: float = 1.0, top_k: int | None = None):
    """Per-position KL(teacher || student) of the softmax at `temperature`: [..., V] logits -> [...].

    With `top_k`, the KL of the two distributions coarsened to the teacher's k most likely tokens plus one bucket for
    the rest of each one's mass. Unlike renormalising over the k tokens, the bucket still penalises the student for
    mass it puts elsewhere; it is a lower bound of the full KL, equal to it at k = V. What the loss keeps for the
    backward pass from the teacher is k + 1 probabilities per position instead of V."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher_logits = teacher_logits.float() / temperature
    if top_k is None or top_k >= teacher_logits.shape[-1]:
        return F.kl_div(student, F.log_softmax(teacher_logits, dim=-1), reduction="none", log_target=True).sum(-1)
    with torch.no_grad():
        values, index = teacher_logits.topk(top_k, dim=-1)
        normaliser = teacher_logits.logsumexp(-1, keepdim=True)
        teacher_top = values - normaliser
        # The rest's mass from the logits outside the top k (not 1 - sum, which cancels).
        teacher_rest = (teacher_logits.scatter(-1, index, -torch.inf).logsumexp(-1) - normaliser[..., 0]).exp()
    student_top = student.gather(-1, index)
    # log of the student's rest from the logits outside the top k, not log(1 - sum): that cancels (and its gradient
    # blows up) when the top k hold nearly all the mass.
    student_rest = student.scatter(-1, index, -torch.inf).logsumexp(-1)
    kl = (teacher_top.exp() * (teacher_top - student_top)).sum(-1)
    return kl + torch.xlogy(teacher_rest, teacher_rest) - teacher_rest * student_rest


def distillation_objective(outputs, kl, router_coef: float, alpha: float, temperature: float = 1.0):
    """`(1 - alpha) * (L_LM + c * L_balance) + alpha * (c * L_balance + T^2 * kl)`: a causal LM's own loss
    (`outputs.loss`, which holds its balance loss `outputs.aux_loss` at `router_coef` c) traded against the KL at
    `temperature`, the balance loss kept at its full weight. T^2 keeps the KL's gradient scale independent of T."""
    aux = getattr(outputs, "aux_loss", None)
    router = router_coef * aux if aux is not None else 0.0
    return (1 - alpha) * outputs.loss + alpha * (router + temperature**2 * kl)

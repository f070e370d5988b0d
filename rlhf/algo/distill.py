"""On-policy distillation's per-token signals. Sampled (Thinking Machines' on-policy distillation, verl PR #5041):
on the token the student sampled, teacher logprob - student logprob is minus the one-sample reverse-KL estimate
KL(student || teacher); as an advantage it raises the tokens the teacher likes more than the student does.
Top-K (NeMo-RL's): the KL between the teacher and the student on the teacher's K most likely ids per position, a
term of the actor's loss, which also names the tokens the student should have put its mass on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.algo.aggregation import GlobalCounts, aggregate_loss
from rlhf.algo.config import LossAggMode


@dataclass(frozen=True)
class DistillSignal:
    """`advantages_bt`: coef x the clipped signal (0 off the loss mask); `metrics`: `distill/*` of the batch."""

    advantages_bt: torch.Tensor
    metrics: dict[str, float]


def reverse_kl_advantages(teacher_logprobs_bt: torch.Tensor, student_logprobs_bt: torch.Tensor,
                          loss_mask_bt: torch.Tensor, *, coef: float, clip: float) -> DistillSignal:
    """coef x clamp(teacher - student, -clip, clip) on the loss mask's tokens (`clip` 0: unclipped), all `[B, T]`
    response-aligned; the metrics are token means over the mask."""
    mask_bt = loss_mask_bt.bool()
    signal_bt = torch.where(mask_bt, teacher_logprobs_bt.float() - student_logprobs_bt.float(), 0.0)
    clipped_bt = signal_bt.clamp(-clip, clip) if clip > 0 else signal_bt
    num_tokens = max(int(mask_bt.sum()), 1)

    def token_mean(x_bt: torch.Tensor) -> float:
        return float(torch.where(mask_bt, x_bt, 0.0).sum() / num_tokens)

    metrics = {"distill/reverse_kl": -token_mean(signal_bt),
               "distill/teacher_logprob": token_mean(teacher_logprobs_bt.float()),
               "distill/student_logprob": token_mean(student_logprobs_bt.float()),
               "distill/clip_fraction": token_mean((clipped_bt != signal_bt).float()),
               "distill/advantage_mean": token_mean(coef * clipped_bt)}
    return DistillSignal(advantages_bt=coef * clipped_bt, metrics=metrics)


def topk_kl_bt(student_logprobs_btk: torch.Tensor, teacher_logprobs_btk: torch.Tensor, *,
               reverse: bool) -> torch.Tensor:
    """Per position `[B, T]`, the KL between teacher and student restricted to the teacher's top-K ids and
    renormalised on them (`[B, T, K]` logprobs at the same ids; the teacher's is a constant): forward
    KL(teacher || student) = sum_k t_k (log t_k - log s_k), or with `reverse` KL(student || teacher). With K =
    the vocabulary it is the exact KL; teacher = student gives 0 and a zero gradient."""
    log_s = student_logprobs_btk.float()
    log_s = log_s - log_s.logsumexp(dim=-1, keepdim=True)
    log_t = teacher_logprobs_btk.detach().float()
    log_t = log_t - log_t.logsumexp(dim=-1, keepdim=True)
    if reverse:
        return (log_s.exp() * (log_s - log_t)).sum(dim=-1)
    return (log_t.exp() * (log_t - log_s)).sum(dim=-1)


def topk_distill_loss(student_logprobs_btk: torch.Tensor, teacher_logprobs_btk: torch.Tensor,
                      loss_mask_bt: torch.Tensor, *, coef: float, reverse: bool, agg: LossAggMode,
                      counts: GlobalCounts, norm_length: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of coef x the top-K KL aggregated like the policy loss (`agg`, global `counts`),
    and the shares of `distill/topk_kl` (token mean of the KL) and `distill/topk_loss` (the aggregated term)."""
    kl_bt = topk_kl_bt(student_logprobs_btk, teacher_logprobs_btk, reverse=reverse)
    term = coef * aggregate_loss(kl_bt, loss_mask_bt, mode=agg, counts=counts, norm_length=norm_length)
    token_sum = torch.where(loss_mask_bt.bool(), kl_bt.detach(), 0.0).sum()
    return term, {"distill/topk_kl": float(token_sum) / max(counts.num_tokens, 1),
                  "distill/topk_loss": float(term.detach())}


def topk_teacher_metrics(teacher_logprobs_bt: torch.Tensor, teacher_topk_logprobs_btk: torch.Tensor,
                         teacher_topk_ids_btk: torch.Tensor, tokens_bt: torch.Tensor,
                         loss_mask_bt: torch.Tensor) -> dict[str, float]:
    """`distill/*` of the teacher's side of the top-K estimator on the global batch (token means over the mask):
    its logprob of the sampled tokens, the mass its top-K holds, how often the sampled token is among them."""
    mask_bt = loss_mask_bt.bool()
    num_tokens = max(int(mask_bt.sum()), 1)

    def token_mean(x_bt: torch.Tensor) -> float:
        return float(torch.where(mask_bt, x_bt.float(), 0.0).sum() / num_tokens)

    return {"distill/teacher_logprob": token_mean(teacher_logprobs_bt),
            "distill/teacher_topk_mass": token_mean(teacher_topk_logprobs_btk.exp().sum(dim=-1)),
            "distill/sampled_in_topk": token_mean((teacher_topk_ids_btk == tokens_bt[..., None]).any(dim=-1))}

"""On-policy distillation's per-token signal (Thinking Machines' on-policy distillation, verl PR #5041): on the
token the student sampled, teacher logprob - student logprob is minus the one-sample reverse-KL estimate
KL(student || teacher); as an advantage it raises the tokens the teacher likes more than the student does."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

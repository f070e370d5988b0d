"""On-policy distillation's reverse-KL advantage: hand-computed values, clipping, the loss mask, zero signal."""

import torch

from rlhf.algo.distill import reverse_kl_advantages

T = torch.tensor
MASK = T([[True, True, False], [True, False, True]])  # row 1: an interior zero (a multi-turn observation token)
TEACHER = T([[-0.5, -2.0, -9.0], [-1.0, -7.0, -0.25]])
STUDENT = T([[-1.5, -0.5, -3.0], [-1.0, -0.1, -3.25]])


def test_advantage_is_coef_times_teacher_minus_student_on_masked_tokens():
    signal = reverse_kl_advantages(TEACHER, STUDENT, MASK, coef=0.5, clip=0.0)
    assert torch.equal(signal.advantages_bt, T([[0.5, -0.75, 0.0], [0.0, 0.0, 1.5]]))
    # token means over the 4 masked tokens: teacher - student = 1, -1.5, 0, 3
    assert signal.metrics == {"distill/reverse_kl": -2.5 / 4, "distill/teacher_logprob": -3.75 / 4,
                              "distill/student_logprob": -6.25 / 4, "distill/clip_fraction": 0.0,
                              "distill/advantage_mean": 1.25 / 4}


def test_clip_bounds_each_token_signal():
    signal = reverse_kl_advantages(TEACHER, STUDENT, MASK, coef=2.0, clip=1.2)
    assert torch.equal(signal.advantages_bt, T([[2.0, -2.4, 0.0], [0.0, 0.0, 2.4]]))
    assert signal.metrics["distill/clip_fraction"] == 0.5  # -1.5 and 3 of the 4 tokens


def test_teacher_equal_to_student_gives_zero_signal():
    signal = reverse_kl_advantages(STUDENT, STUDENT.clone(), MASK, coef=3.0, clip=0.0)
    assert torch.equal(signal.advantages_bt, torch.zeros(2, 3))
    assert signal.metrics["distill/reverse_kl"] == 0.0


def test_empty_mask_gives_zero_metrics_not_nan():
    signal = reverse_kl_advantages(TEACHER, STUDENT, torch.zeros(2, 3, dtype=torch.bool), coef=1.0, clip=0.0)
    assert torch.equal(signal.advantages_bt, torch.zeros(2, 3))
    assert all(value == 0.0 for value in signal.metrics.values())

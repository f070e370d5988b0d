"""Distillation's top-K KL term: hand-computed values and gradients, K = vocab is the exact KL, teacher = student
gives zero loss and zero gradient, every aggregation mode, and the config's one-line errors."""

import math

import pytest
import torch

from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import LossAggMode
from rlhf.algo.distill import topk_distill_loss, topk_kl_bt, topk_teacher_metrics
from rlhf.errors import ConfigError
from rlhf.stages.distill_config import DistillConfig, DistillKL
from rlhf.stages.distill import check_topk

T = torch.tensor


def test_hand_computed_two_ids():
    # teacher on 2 ids: probs (0.6, 0.2), renormalised (0.75, 0.25); student (0.1, 0.3) -> (0.25, 0.75)
    teacher = T([[[math.log(0.6), math.log(0.2)]]])
    student = T([[[math.log(0.1), math.log(0.3)]]], requires_grad=True)
    forward = topk_kl_bt(student, teacher, reverse=False)
    expected = 0.75 * math.log(0.75 / 0.25) + 0.25 * math.log(0.25 / 0.75)
    assert abs(float(forward) - expected) < 1e-6
    forward.sum().backward()
    # d KL(t || s) / d log s_k = s_hat_k - t_hat_k (renormalisation's softmax)
    assert torch.allclose(student.grad, T([[[0.25 - 0.75, 0.75 - 0.25]]]), atol=1e-6)
    student.grad = None
    reverse = topk_kl_bt(student, teacher, reverse=True)
    assert abs(float(reverse) - (0.25 * math.log(0.25 / 0.75) + 0.75 * math.log(0.75 / 0.25))) < 1e-6
    reverse.sum().backward()
    # d KL(s || t) / d log s_k = s_k (log s_k - log t_k - KL)
    s_hat, t_hat, kl = T([0.25, 0.75]), T([0.75, 0.25]), float(reverse)
    assert torch.allclose(student.grad[0, 0], s_hat * ((s_hat / t_hat).log() - kl), atol=1e-6)


def test_full_vocab_is_the_exact_kl():
    gen = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(3, 4, 11, generator=gen) * 2, dim=-1)
    student = torch.log_softmax(torch.randn(3, 4, 11, generator=gen), dim=-1)
    exact_forward = (teacher.exp() * (teacher - student)).sum(-1)
    exact_reverse = (student.exp() * (student - teacher)).sum(-1)
    assert torch.allclose(topk_kl_bt(student, teacher, reverse=False), exact_forward, atol=1e-6)
    assert torch.allclose(topk_kl_bt(student, teacher, reverse=True), exact_reverse, atol=1e-6)
    # a permutation of the ids (the teacher's order) changes nothing
    order = torch.randperm(11, generator=gen)
    assert torch.allclose(topk_kl_bt(student[..., order], teacher[..., order], reverse=False), exact_forward,
                          atol=1e-6)


@pytest.mark.parametrize("reverse", [False, True])
def test_teacher_equal_to_student_gives_zero_loss_and_grad(reverse):
    student = torch.log_softmax(torch.randn(2, 3, 5), dim=-1)[..., :3].clone().requires_grad_()
    mask = T([[True, True, False], [True, False, True]])
    counts = GlobalCounts(num_tokens=4, num_seqs=2)
    loss, metrics = topk_distill_loss(student, student.detach().clone(), mask, coef=2.0, reverse=reverse,
                                      agg=LossAggMode.TOKEN_MEAN, counts=counts)
    loss.backward()
    assert abs(float(loss)) < 1e-7 and float(student.grad.abs().max()) < 1e-7
    assert abs(metrics["distill/topk_kl"]) < 1e-7


AGG_EXPECTED = {  # per-token KL k (mask as below: row 0 tokens 0, 1; row 1 tokens 0, 2), counts 4 tokens 2 seqs
    LossAggMode.TOKEN_MEAN: lambda k: (k[0, 0] + k[0, 1] + k[1, 0] + k[1, 2]) / 4,
    LossAggMode.TOKEN_SUM: lambda k: k[0, 0] + k[0, 1] + k[1, 0] + k[1, 2],
    LossAggMode.SEQ_MEAN_TOKEN_SUM: lambda k: ((k[0, 0] + k[0, 1]) + (k[1, 0] + k[1, 2])) / 2,
    LossAggMode.SEQ_MEAN_TOKEN_MEAN: lambda k: ((k[0, 0] + k[0, 1]) / 2 + (k[1, 0] + k[1, 2]) / 2) / 2,
    LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM: lambda k: ((k[0, 0] + k[0, 1]) / 8 + (k[1, 0] + k[1, 2]) / 8) / 2,
}


@pytest.mark.parametrize("agg", list(AGG_EXPECTED))
def test_every_aggregation_mode(agg):
    gen = torch.Generator().manual_seed(1)
    teacher = torch.log_softmax(torch.randn(2, 3, 6, generator=gen), dim=-1)[..., :4]
    student = torch.log_softmax(torch.randn(2, 3, 6, generator=gen), dim=-1)[..., :4]
    student[1, 1] = float("nan")  # off the mask: never reaches the loss
    mask = T([[True, True, False], [True, False, True]])
    kl = topk_kl_bt(student, teacher, reverse=False)
    loss, metrics = topk_distill_loss(student, teacher, mask, coef=0.5, reverse=False, agg=agg,
                                      counts=GlobalCounts(num_tokens=4, num_seqs=2),
                                      norm_length=8 if agg is LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM else None)
    assert abs(float(loss) - 0.5 * float(AGG_EXPECTED[agg](kl))) < 1e-6
    assert abs(metrics["distill/topk_kl"] - float(AGG_EXPECTED[LossAggMode.TOKEN_MEAN](kl))) < 1e-6
    assert metrics["distill/topk_loss"] == float(loss)


def test_teacher_metrics():
    logp = T([[[math.log(0.5), math.log(0.25)], [math.log(0.9), math.log(0.05)]]])
    ids = T([[[3, 1], [2, 0]]])
    metrics = topk_teacher_metrics(T([[-1.0, -3.0]]), logp, ids, T([[1, 5]]), T([[True, True]]))
    assert metrics == pytest.approx({"distill/teacher_logprob": -2.0, "distill/teacher_topk_mass": 0.85,
                                     "distill/sampled_in_topk": 0.5})


def test_defaults_and_bad_input():
    assert DistillConfig().estimator == "sampled" and DistillConfig().topk is None
    config = DistillConfig(estimator="topk")
    assert (config.topk, config.kl) == (16, DistillKL.FORWARD)
    assert DistillConfig(estimator="topk", topk=3, kl="reverse").kl is DistillKL.REVERSE
    with pytest.raises(ConfigError, match=r"^algo.distill.topk=0 must be an integer >= 1"):
        DistillConfig(estimator="topk", topk=0)
    with pytest.raises(ConfigError, match=r"^algo.distill.topk=8 is read only by the top-K estimator: set "
                                          r"algo.distill.estimator=topk"):
        DistillConfig(topk=8)
    with pytest.raises(ConfigError, match=r"^algo.distill.kl=forward is read only by the top-K estimator"):
        DistillConfig(kl="forward")
    with pytest.raises(ConfigError, match=r"algo.distill.kl.*'forwards'.*did you mean 'forward'"):
        DistillConfig(estimator="topk", kl="forwards")
    with pytest.raises(ConfigError, match=r"algo.distill.estimator.*did you mean 'topk'"):
        DistillConfig(estimator="top-k")
    topk = DistillConfig(estimator="topk", topk=40)
    check_topk(topk, 40, [("algo.distill.teacher_path", 40)], True)  # K = vocab is fine
    check_topk(DistillConfig(), 4, [("algo.distill.teacher_path", 7)], False)  # sampled: nothing to check
    with pytest.raises(ConfigError, match=r"^algo.distill.topk=40 is larger than the vocabulary \(39 tokens, "
                                          r"model.path\); set algo.distill.topk <= 39$"):
        check_topk(topk, 39, [], True)
    with pytest.raises(ConfigError, match=r"^algo.distill.routes.x has vocab_size 41, the student 40"):
        check_topk(topk, 40, [("algo.distill.routes.x", 41)], True)
    with pytest.raises(ConfigError, match=r"^algo.distill.estimator=topk .* set model.fused_head=true$"):
        check_topk(topk, 40, [], False)

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import KLConfig, KLEstimator
from rlhf.algo.kl import KLController, apply_kl_in_reward, kl_loss, kl_penalty
from rlhf.errors import ConfigError

T = torch.tensor


def test_estimators_hand_computed():
    logp, ref = T([0.0, -1.0, -30.0]), T([-0.5, -0.5, 0.0])  # log r = 0.5, -0.5, -30
    torch.testing.assert_close(kl_penalty(logp, ref, KLEstimator.K1), T([0.5, -0.5, -30.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, KLEstimator.ABS), T([0.5, 0.5, 30.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, KLEstimator.K2), T([0.125, 0.125, 450.0]))
    # k3 = exp(-log r) + log r - 1, log-ratio clamped to 20 and value clamped to 10
    expected_k3 = T([math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1, 10.0])
    torch.testing.assert_close(kl_penalty(logp, ref, KLEstimator.K3), expected_k3)


def test_verl_names_are_aliases():
    assert KLConfig(estimator="low_var_kl").estimator is KLEstimator.K3
    assert KLConfig(estimator="mse").estimator is KLEstimator.K2
    assert KLConfig(estimator="kl").estimator is KLEstimator.K1
    with pytest.raises(ConfigError, match="unknown KL estimator 'k4'"):
        KLConfig(estimator="k4")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-4, 0), st.floats(-4, 0)), min_size=1, max_size=10),
       st.sampled_from(list(KLEstimator)))
def test_straight_through_keeps_value_and_takes_k2_gradient(pairs, estimator):
    logp = T([p for p, _ in pairs], dtype=torch.float64, requires_grad=True)
    ref = T([r for _, r in pairs], dtype=torch.float64)
    straight = kl_penalty(logp, ref, estimator, straight_through=True)
    torch.testing.assert_close(straight, kl_penalty(logp, ref, estimator))
    (grad_st,) = torch.autograd.grad(straight.sum(), logp)
    (grad_k2,) = torch.autograd.grad(kl_penalty(logp, ref, KLEstimator.K2).sum(), logp)
    torch.testing.assert_close(grad_st, grad_k2)


def test_kl_in_reward_hand_computed():
    scores = T([[0.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0]])
    out = apply_kl_in_reward(scores, T([[0.0, -1.0, 3.0]]), T([[-0.5, -0.5, 0.0]]), mask, KLEstimator.K1, 0.1)
    torch.testing.assert_close(out.token_rewards_bt, T([[-0.05, 1.05, 0.0]]))
    torch.testing.assert_close(out.seq_kl_b, T([0.0]))


def test_kl_loss_term():
    logp = T([[0.0, -1.0]], requires_grad=True)
    config = KLConfig(estimator="k2", coef=0.5)
    term, value = kl_loss(logp, T([[-0.5, -0.5]]), T([[1.0, 1.0]]), config, GlobalCounts(num_tokens=2, num_seqs=1))
    assert value.item() == pytest.approx(0.125) and term.item() == pytest.approx(0.0625)
    assert config.use_as_loss and not config.use_in_reward


def test_adaptive_controller_steps_and_state():
    config = KLConfig(coef=0.2, in_reward=True, controller="adaptive", target=0.1, horizon=100)
    controller = KLController.from_config(config)
    controller.update(current_kl=0.15, num_samples=10)  # error clipped to +0.2 -> x1.02
    assert controller.value == pytest.approx(0.204)
    controller.update(current_kl=0.05, num_samples=10)  # error clipped to -0.2 -> x0.98
    assert controller.value == pytest.approx(0.204 * 0.98)
    restored = KLController.from_config(config)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    fixed = KLController.from_config(KLConfig(coef=0.2, in_reward=True))
    fixed.update(current_kl=5.0, num_samples=10)
    assert fixed.value == 0.2


def test_bad_kl_configs():
    with pytest.raises(ConfigError, match="KL controller 'adaptive' only applies to the in-reward penalty"):
        KLConfig(coef=0.1, controller="adaptive", target=0.1, horizon=10)
    with pytest.raises(ConfigError, match="needs target > 0 and horizon > 0, got target=None horizon=10"):
        KLConfig(coef=0.1, in_reward=True, controller="adaptive", horizon=10)
    with pytest.raises(ConfigError, match="KL coef must be >= 0, got -1"):
        KLConfig(coef=-1)

import pytest
import torch

from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import ValueLossConfig
from rlhf.algo.value_loss import explained_variance, value_loss
from rlhf.errors import ConfigError

T = torch.tensor
NAN = float("nan")


def test_clipped_value_loss_hand_computed():
    values = T([[1.0, 2.0], [0.0, NAN]], requires_grad=True)
    old_values = T([[0.5, 2.0], [0.0, NAN]])
    returns = T([[2.0, 1.0], [1.0, NAN]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = value_loss(values, old_values, returns, mask, ValueLossConfig(clip_range_value=0.2),
                               GlobalCounts(num_tokens=3, num_seqs=2))
    # token 1: clipped to 0.7 -> (0.7 - 2)^2 = 1.69 beats (1 - 2)^2 = 1; tokens 2, 3: 1 each
    assert loss.item() == pytest.approx(0.5 * 3.69 / 3)
    assert metrics.vf_clipfrac.item() == pytest.approx(1 / 3)
    assert metrics.vpred_mean.item() == pytest.approx(1.0)
    (grad,) = torch.autograd.grad(loss, values)
    # token 1 is clipped (no gradient); others 0.5 * 2 (v - R) / 3
    torch.testing.assert_close(grad, T([[0.0, 1 / 3], [-1 / 3, 0.0]]))
    unclipped, _ = value_loss(values, old_values, returns, mask, ValueLossConfig(clip_range_value=None),
                              GlobalCounts(num_tokens=3, num_seqs=2))
    assert unclipped.item() == pytest.approx(0.5 * 3 / 3)


def test_explained_variance_hand_computed():
    returns = T([[2.0, 1.0], [1.0, 50.0]])
    values = T([[1.0, 2.0], [0.0, -7.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    # Var[R - V] = 4/3, Var[R] = 1/3 (unbiased, masked) -> 1 - 4 = -3
    assert explained_variance(values, returns, mask).item() == pytest.approx(-3.0)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)


def test_bad_clip_range():
    with pytest.raises(ConfigError, match="clip_range_value must be > 0 or None, got 0.0"):
        ValueLossConfig(clip_range_value=0.0)

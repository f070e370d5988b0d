import math

import pytest
import torch

from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import PolicyLossConfig
from rlhf.algo.policy_loss import policy_loss
from rlhf.errors import ConfigError

T = torch.tensor
NAN = float("nan")


def _ppo_case():
    """Tokens: (A=+1, r=1.5) (A=+1, r=0.5) (A=-1, r=0.5) | (A=-1, r=5) (A=-2, r=1) padding."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = T([[math.log(1.5), math.log(0.5), math.log(0.5)], [math.log(5.0), 0.0, NAN]],
            dtype=torch.float64, requires_grad=True)
    advantages = T([[1.0, 1.0, -1.0], [-1.0, -2.0, NAN]], dtype=torch.float64)
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return new, old, advantages, mask, GlobalCounts(num_tokens=5, num_seqs=2)


def test_ppo_clip_higher_and_dual_clip_hand_computed():
    new, old, advantages, mask, counts = _ppo_case()
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    loss, metrics = policy_loss(new, old, advantages, mask, config, counts)
    # per token: -1.28 (upper clip), -0.5, 0.8 (lower clip), 3.0 (dual clip caps 5.0), 2.0
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 3.0 + 2.0) / 5)
    assert metrics.pg_clipfrac.item() == pytest.approx(2 / 5)
    assert metrics.pg_clipfrac_lower.item() == pytest.approx(1 / 5)
    expected_kl = -(math.log(1.5) + 2 * math.log(0.5) + math.log(5.0)) / 5
    assert metrics.ppo_kl.item() == pytest.approx(expected_kl)
    assert metrics.pg_loss.item() == loss.item()
    (grad,) = torch.autograd.grad(loss, new)
    # only unclipped tokens carry gradient: -A * r / num_tokens
    torch.testing.assert_close(grad, T([[0.0, -0.5 / 5, 0.0], [0.0, 2.0 / 5, 0.0]], dtype=torch.float64))


def test_ppo_without_dual_clip():
    new, old, advantages, mask, counts = _ppo_case()
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=None)
    loss, metrics = policy_loss(new, old, advantages, mask, config, counts)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 5.0 + 2.0) / 5)
    assert metrics.pg_clipfrac_lower.item() == 0.0


def test_gspo_sequence_ratio_hand_computed():
    # seq 1: token log-ratios [ln 2, 0] -> s = sqrt(2), A = +1: clipped at 1.2
    # seq 2: [ln 0.9, ln 0.9] -> s = 0.9, A = +1: inside the range; seq 3: [ln 1.1] -> s = 1.1, A = -1
    old = torch.zeros(3, 2, dtype=torch.float64)
    new = T([[math.log(2.0), 0.0], [math.log(0.9), math.log(0.9)], [math.log(1.1), NAN]],
            dtype=torch.float64, requires_grad=True)
    advantages = T([[1.0, 1.0], [1.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    mask = T([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    config = PolicyLossConfig(kind="gspo", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean")
    loss, metrics = policy_loss(new, old, advantages, mask, config, GlobalCounts(num_tokens=5, num_seqs=3))
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 1.1) / 3)
    assert metrics.pg_clipfrac.item() == pytest.approx(2 / 5)
    (grad,) = torch.autograd.grad(loss, new)
    # d/dlogp of s_tok is s (the value): seq 2 tokens -0.9 / 2 / 3, seq 3 token +1.1 / 1 / 3
    torch.testing.assert_close(grad, T([[0.0, 0.0], [-0.15, -0.15], [1.1 / 3, 0.0]], dtype=torch.float64))


def test_all_zero_mask_gives_finite_zero():
    new = torch.full((2, 2), NAN, requires_grad=True)
    for kind in ["ppo", "gspo"]:
        loss, metrics = policy_loss(new, torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 2),
                                    PolicyLossConfig(kind=kind), GlobalCounts(num_tokens=0, num_seqs=0))
        (grad,) = torch.autograd.grad(loss, new)
        assert loss.item() == 0.0 and metrics.ppo_kl.item() == 0.0 and torch.equal(grad, torch.zeros(2, 2))


def test_metrics_use_verl_names():
    new, old, advantages, mask, counts = _ppo_case()
    _, metrics = policy_loss(new, old, advantages, mask, PolicyLossConfig(), counts)
    assert sorted(metrics.as_dict()) == ["actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/pg_loss",
                                         "actor/ppo_kl"]


def test_bad_config_values():
    with pytest.raises(ConfigError, match="policy clip_ratio_c \\(dual-clip\\) must be > 1.0 or None, got 0.5"):
        PolicyLossConfig(clip_ratio_c=0.5)
    with pytest.raises(ConfigError, match="policy clip_low must be in \\[0, 1\\), got 1.0"):
        PolicyLossConfig(clip_low=1.0)
    with pytest.raises(ConfigError, match="unknown policy loss 'gpso' \\(did you mean 'gspo'\\?\\)"):
        PolicyLossConfig(kind="gpso")

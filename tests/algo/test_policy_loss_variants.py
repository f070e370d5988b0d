"""CISPO, GMPO, SAPO, GPG, DPPO-TV/KL, Clip-Cov, KL-Cov: hand-computed values and gradients on small cases."""

import math

import pytest
import torch

from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import LossAggMode, PolicyLossConfig, PolicyLossKind
from rlhf.algo.policy_loss import POLICY_LOSSES, policy_loss
from rlhf.algo.policy_loss_cov import covariance_selection
from rlhf.errors import ConfigError

T = torch.tensor
LN = math.log
NAN = float("nan")
F64 = torch.float64
# Row 0 has an interior zero (its middle token is masked and NaN), row 1 is one token long, row 2 is empty.
MASK = T([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
OLD_P = [[0.5, 0.5, 0.4], [0.2, 0.3, 0.3], [0.5, 0.5, 0.5]]
COUNTS = GlobalCounts(num_tokens=3, num_seqs=2)


def _case(ratios, advantages):
    """old / new log-probs with new = old * ratio on the mask (NaN elsewhere) and advantages (NaN elsewhere)."""
    old = T([[LN(p) for p in row] for row in OLD_P], dtype=F64)
    new = old + T([[LN(r) for r in row] for row in ratios], dtype=F64)
    new = torch.where(MASK.bool(), new, torch.full_like(new, NAN)).requires_grad_()
    adv = torch.where(MASK.bool(), T(advantages, dtype=F64), torch.full_like(old, NAN))
    return new, old, adv


def _run(kind, ratios, advantages, counts=COUNTS, weights=None, selected=None, **config):
    new, old, adv = _case(ratios, advantages)
    config = PolicyLossConfig(kind=kind, **config)
    loss, metrics = policy_loss(new, old, adv, MASK, config, counts, is_weights_bt=weights, cov_selected_bt=selected)
    (grad,) = torch.autograd.grad(loss, new)
    assert torch.isfinite(grad).all() and (grad[~MASK.bool()] == 0).all()
    return loss.item(), grad, metrics


RATIOS = [[1.5, 1.0, 0.5], [1.1, 1.0, 1.0], [1.0, 1.0, 1.0]]
ADV = [[1.0, 0.0, -1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
LOGP = [LN(0.75), LN(0.2), LN(0.22)]  # the current log-probs of the three response tokens


def _grad(values):
    return T([[values[0], 0.0, values[1]], [values[2], 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)


def test_cispo_weights_log_pi_by_the_detached_clipped_ratio():
    loss, grad, metrics = _run("cispo", RATIOS, ADV, clip_low=0.2, clip_high=0.28)
    # clip(r): 1.5 -> 1.28 (upper), 0.5 -> 0.8 (lower), 1.1 stays; loss = -sg[clip r] A log pi, token mean over 3
    assert loss == pytest.approx((-1.28 * LOGP[0] + 0.8 * LOGP[1] - 2.2 * LOGP[2]) / 3)
    torch.testing.assert_close(grad, _grad([-1.28 / 3, 0.8 / 3, -2.2 / 3]))  # every token keeps a gradient
    assert metrics.pg_clipfrac.item() == pytest.approx(2 / 3)
    assert metrics.ppo_kl.item() == pytest.approx(-(LN(1.5) + LN(0.5) + LN(1.1)) / 3)


def test_gpg_is_minus_advantage_times_log_pi_with_is_weights():
    weights = T([[2.0, 9.0, 0.5], [1.0, 9.0, 9.0], [9.0, 9.0, 9.0]], dtype=F64)  # padding weights never count
    loss, grad, _ = _run("gpg", RATIOS, ADV, weights=weights)
    assert loss == pytest.approx((-2.0 * LOGP[0] + 0.5 * LOGP[1] - 2.0 * LOGP[2]) / 3)
    torch.testing.assert_close(grad, _grad([-2.0 / 3, 0.5 / 3, -2.0 / 3]))


def test_sapo_gate_value_and_gradient():
    loss, grad, metrics = _run("sapo", RATIOS, ADV, tau_pos=1.0, tau_neg=1.05)

    def sig(x):
        return 1.0 / (1.0 + math.exp(-x))

    values = [-1.0 * 4.0 * sig(0.5), 1.0 * 4.0 / 1.05 * sig(1.05 * -0.5), -2.0 * 4.0 * sig(0.1)]
    assert loss == pytest.approx(sum(values) / 3)
    # d/dlog pi of (4/tau) sig(tau (r - 1)) is 4 sig'(.) r: at r = 1 exactly the policy gradient
    slopes = [4 * sig(0.5) * (1 - sig(0.5)) * 1.5, 4 * sig(-0.525) * (1 - sig(-0.525)) * 0.5,
              4 * sig(0.1) * (1 - sig(0.1)) * 1.1]
    torch.testing.assert_close(grad, _grad([-1.0 * slopes[0] / 3, 1.0 * slopes[1] / 3, -2.0 * slopes[2] / 3]))
    assert metrics.pg_clipfrac.item() == 0.0
    at_one, grad_at_one, _ = _run("sapo", [[1.0] * 3] * 3, ADV)
    torch.testing.assert_close(grad_at_one, _grad([-1.0 / 3, 1.0 / 3, -2.0 / 3]))


def test_geo_mean_clips_log_ratios_by_the_advantage_sign_and_averages_rows():
    ratios = [[1.5, 1.0, 0.9], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0]]
    adv = [[1.0, 0.0, 1.0], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    # row 0 (A = +1): log 1.5 capped at 0.28, log 0.9 free -> ratio exp((0.28 + ln 0.9) / 2)
    # row 1 (A = -2): log 0.5 held at -0.2 -> ratio exp(-0.2), no gradient
    row0 = math.exp((0.28 + LN(0.9)) / 2)
    loss, grad, metrics = _run("geo_mean", ratios, adv, clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean")
    assert loss == pytest.approx((-row0 + 2.0 * math.exp(-0.2)) / 2)
    torch.testing.assert_close(grad, _grad([0.0, -row0 / 2 / 2, 0.0]))
    assert metrics.pg_clipfrac.item() == pytest.approx(1 / 3)  # the A > 0 token clipped above
    assert metrics.pg_clipfrac_lower.item() == pytest.approx(1 / 3)  # the A < 0 token clipped below
    token_mean, _, _ = _run("gmpo", ratios, adv, clip_low=0.2, clip_high=0.28, agg="token-mean")
    assert token_mean == pytest.approx((2 * -row0 + 2.0 * math.exp(-0.2)) / 3)  # the row's loss on each token
    weights = T([[4.0, 0.0, 1.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    weighted, _, _ = _run("geo_mean", ratios, adv, weights=weights, clip_low=0.2, clip_high=0.28,
                          agg="seq-mean-token-mean")
    assert weighted == pytest.approx((-row0 * 2.0 + 2.0 * math.exp(-0.2) * 0.5) / 2)  # geometric mean of weights


def test_dppo_tv_masks_tokens_whose_probability_moved_too_far():
    # token 0: p 0.5 -> 0.8 (A > 0, +0.3 > 0.28: masked); token 2: p 0.4 -> 0.2 (A < 0, -0.2 >= -0.2: kept at the
    # boundary); row 1: p 0.2 -> 0.8, A < 0, r = 4 truncated at clip_ratio_c = 3
    ratios = [[1.6, 1.0, 0.5], [4.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    adv = [[1.0, 0.0, -1.0], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    loss, grad, metrics = _run("dppo_tv", ratios, adv, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    assert loss == pytest.approx((0.5 * LN(0.2) + 2.0 * 3.0 * LN(0.8)) / 3)
    torch.testing.assert_close(grad, _grad([0.0, 0.5 / 3, 6.0 / 3]))
    assert metrics.pg_clipfrac.item() == pytest.approx(1 / 3)  # masked
    assert metrics.pg_clipfrac_lower.item() == pytest.approx(1 / 3)  # truncated


def _binary_kl(p_old, p):
    return p_old * LN(p_old / p) + (1 - p_old) * LN((1 - p_old + 1e-8) / (1 - p + 1e-8))


def test_dppo_kl_masks_by_the_binary_kl_in_the_direction_of_the_update():
    ratios = [[1.6, 1.0, 0.5], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0]]
    adv = [[1.0, 0.0, -1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    low, high = 0.05, 0.1
    assert _binary_kl(0.5, 0.8) > high  # p rises with A > 0 past the bound: masked
    assert _binary_kl(0.4, 0.2) > low  # p falls with A < 0 past the bound: masked
    # row 1: p falls with A > 0 -> kept whatever its KL
    loss, grad, metrics = _run("dppo_kl", ratios, adv, clip_low=low, clip_high=high, clip_ratio_c=None)
    assert loss == pytest.approx(-1.0 * 0.5 * LN(0.1) / 3)
    torch.testing.assert_close(grad, _grad([0.0, 0.0, -0.5 / 3]))
    assert metrics.pg_clipfrac.item() == pytest.approx(2 / 3)


def test_covariance_selection_on_the_global_batch():
    advantages = T([[1.0, 5.0, -1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    logprobs = T([[-1.0, NAN, -3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    # tokens (A, log p): (1, -1) (-1, -3) (3, 0); means A = 1, log p = -4/3; cov = 0, 10/3, 8/3
    kl = covariance_selection(PolicyLossConfig(kind="kl_cov", kl_cov_ratio=0.4), advantages, logprobs, MASK,
                              torch.Generator().manual_seed(0))
    assert kl.tolist() == [[False, False, True], [False, False, False], [False, False, False]]  # top 1 of 3
    clip = covariance_selection(PolicyLossConfig(kind="clip_cov", clip_cov_ratio=0.9, clip_cov_lb=2.7,
                                                 clip_cov_ub=5.0), advantages, logprobs, MASK,
                                torch.Generator().manual_seed(0))
    assert clip.tolist() == [[False, False, True], [False, False, False], [False, False, False]]  # 10/3 only
    draws = {tuple(covariance_selection(PolicyLossConfig(kind="clip_cov", clip_cov_ratio=0.4, clip_cov_lb=-1.0),
                                        advantages, logprobs, MASK, torch.Generator().manual_seed(seed)).flatten()
                   .nonzero().flatten().tolist()) for seed in range(20)}
    assert draws == {(0,), (2,), (3,)}  # one of the three candidates, chosen by the generator
    empty = covariance_selection(PolicyLossConfig(kind="kl_cov"), advantages, logprobs, torch.zeros(3, 3),
                                 torch.Generator())
    assert not empty.any()


def test_clip_cov_drops_the_selected_tokens():
    selected = T([[False, False, True], [False, False, False], [False, False, False]])
    loss, grad, metrics = _run("clip_cov", RATIOS, ADV, selected=selected, clip_low=0.2, clip_high=0.28)
    # PPO without dual clip on tokens 0 (1.5 -> clip 1.28) and row 1 (1.1); token 2 is selected: no value, no grad
    assert loss == pytest.approx((-1.28 - 2.2) / 3)
    torch.testing.assert_close(grad, _grad([0.0, 0.0, -2.2 / 3]))
    assert metrics.pg_clipfrac.item() == pytest.approx(1 / 3)


def test_kl_cov_penalises_the_selected_tokens_without_a_clip():
    selected = T([[True, False, False], [False, False, False], [False, False, False]])
    loss, grad, metrics = _run("kl_cov", RATIOS, ADV, selected=selected, ppo_kl_coef=0.5)
    assert loss == pytest.approx((-1.5 + 0.5 * LN(1.5) + 0.5 - 2.2) / 3)
    torch.testing.assert_close(grad, _grad([(-1.5 + 0.5) / 3, 0.5 / 3, -2.2 / 3]))
    assert metrics.pg_clipfrac.item() == pytest.approx(1 / 3)


def test_covariance_losses_need_the_selection():
    with pytest.raises(ConfigError, match=r"policy loss 'clip_cov' needs the step's token selection"):
        _run("clip_cov", RATIOS, ADV)


@pytest.mark.parametrize("kind", [k for k in PolicyLossKind])
@pytest.mark.parametrize("mode", list(LossAggMode))
def test_every_loss_with_every_aggregation_is_finite_and_ignores_padding(kind, mode):
    selected = T([[True, False, False], [False, False, False], [False, False, False]])
    weights = T([[1.5, NAN, 0.5], [1.0, NAN, NAN], [NAN, NAN, NAN]], dtype=F64)
    loss, grad, metrics = _run(kind, RATIOS, ADV, weights=weights, selected=selected, agg=mode, agg_norm_length=3)
    assert math.isfinite(loss) and metrics.pg_loss.item() == loss
    zero_mask = torch.zeros(3, 3)
    new, old, adv = _case(RATIOS, ADV)
    empty, _ = policy_loss(new, old, adv, zero_mask, PolicyLossConfig(kind=kind, agg=mode, agg_norm_length=3),
                           GlobalCounts(num_tokens=0, num_seqs=0), cov_selected_bt=selected.clone())
    (empty_grad,) = torch.autograd.grad(empty, new)
    assert empty.item() == 0.0 and torch.equal(empty_grad, torch.zeros_like(empty_grad))


def test_names_aliases_and_did_you_mean():
    assert POLICY_LOSSES.kinds() == list(PolicyLossKind)
    assert PolicyLossConfig(kind="vanilla").kind is PolicyLossKind.PPO
    assert PolicyLossConfig(kind="gmpo").kind is PolicyLossKind.GEO_MEAN
    with pytest.raises(ConfigError, match=r"unknown policy loss 'cipso' \(did you mean 'cispo'\?\)"):
        PolicyLossConfig(kind="cipso")
    with pytest.raises(ConfigError, match=r"unknown policy loss 'dppo_k1' \(did you mean 'dppo_kl'\?\)"):
        PolicyLossConfig(kind="dppo_k1")
    with pytest.raises(ConfigError, match=r"policy clip_cov_lb=5.0 must be below clip_cov_ub=5.0"):
        PolicyLossConfig(clip_cov_lb=5.0)
    with pytest.raises(ConfigError, match=r"tau_pos=0.0 and tau_neg=1.05 \(SAPO\) must be > 0"):
        PolicyLossConfig(tau_pos=0.0)

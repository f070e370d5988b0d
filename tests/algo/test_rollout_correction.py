import math

import pytest
import torch

from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import PolicyLossConfig
from rlhf.algo.actor_loss import ActorLossInputs, actor_loss
from rlhf.algo.kl import KLConfig
from rlhf.algo.correction_config import RejectionOption, RejectionRule, RolloutCorrectionConfig
from rlhf.algo.rollout_correction import rollout_correction
from rlhf.errors import ConfigError

T = torch.tensor
LN = math.log
# Token ratios pi_old / pi_rollout: row 0 = [2, 0.5, 4], row 1 = [1, 3, padding].
RATIOS = [[2.0, 0.5, 4.0], [1.0, 3.0, 1.0]]


def _case():
    rollout = T([[-1.0, -2.0, -0.5], [-0.3, -1.5, 0.0]], dtype=torch.float64)
    old = rollout + T([[LN(r) for r in row] for row in RATIOS], dtype=torch.float64)
    old[1, 2] = float("nan")  # padding never leaks
    mask = T([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return old, rollout, mask


def _correct(**config):
    old, rollout, mask = _case()
    return rollout_correction(old, rollout, mask, RolloutCorrectionConfig(enable=True, **config))


def test_token_tis_truncates_each_token_at_the_threshold():
    result = _correct(rollout_is="token", rollout_is_threshold=1.8)
    torch.testing.assert_close(result.weights_bt, T([[1.8, 0.5, 1.8], [1.0, 1.8, 0.0]], dtype=torch.float64))
    assert torch.equal(result.keep_mask_bt, _case()[2])
    metrics = result.metrics
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx(6.9 / 5)
    assert metrics["rollout_corr/is_weight_max"] == pytest.approx(1.8)
    assert metrics["rollout_corr/is_weight_min"] == pytest.approx(0.5)
    assert metrics["rollout_corr/is_truncated_fraction"] == pytest.approx(3 / 5)
    assert metrics["rollout_corr/rs_masked_fraction"] == 0.0
    # KL(rollout || old) sampled from the rollout: mean of -log rho; k3 = mean(rho - 1 - log rho)
    assert metrics["rollout_corr/kl"] == pytest.approx(-LN(2 * 0.5 * 4 * 3) / 5)
    k3 = sum(r - 1 - LN(r) for r in [2.0, 0.5, 4.0, 1.0, 3.0]) / 5
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(k3)
    assert metrics["rollout_corr/log_ratio_abs_max"] == pytest.approx(LN(4.0))


def test_sequence_and_geometric_weights_broadcast_over_the_row():
    product = _correct(rollout_is="sequence", rollout_is_threshold=3.5)
    torch.testing.assert_close(product.weights_bt, T([[3.5, 3.5, 3.5], [3.0, 3.0, 0.0]], dtype=torch.float64))
    assert product.metrics["rollout_corr/is_truncated_fraction"] == pytest.approx(3 / 5)
    geometric = _correct(rollout_is="geometric", rollout_is_threshold=10.0)
    g0, g1 = 4.0 ** (1 / 3), 3.0 ** 0.5
    torch.testing.assert_close(geometric.weights_bt, T([[g0, g0, g0], [g1, g1, 0.0]], dtype=torch.float64))
    assert geometric.metrics["rollout_corr/is_truncated_fraction"] == 0.0


def test_token_rejection_and_icepop_band():
    token_mis = _correct(rollout_is=None, rollout_rs="token", rollout_rs_threshold=2.5)  # band [0.4, 2.5]
    assert token_mis.weights_bt is None and "rollout_corr/is_weight_mean" not in token_mis.metrics
    assert token_mis.keep_mask_bt.tolist() == [[True, True, False], [True, False, False]]
    assert token_mis.metrics["rollout_corr/rs_masked_fraction"] == pytest.approx(2 / 5)
    icepop = _correct(rollout_is=None, rollout_rs="token", rollout_rs_threshold=3.2, rollout_rs_threshold_lower=0.6)
    assert icepop.keep_mask_bt.tolist() == [[True, False, False], [True, True, False]]


def test_sequence_rejection_masks_whole_rows_and_keeps_weights():
    seq_mis = _correct(rollout_is="sequence", rollout_is_threshold=3.5, rollout_rs="sequence")
    assert seq_mis.keep_mask_bt.tolist() == [[False, False, False], [True, True, False]]
    assert seq_mis.metrics["rollout_corr/rs_masked_fraction"] == pytest.approx(3 / 5)
    geo = _correct(rollout_is=None, rollout_rs="geometric", rollout_rs_threshold=1.65, rollout_rs_threshold_lower=0.0)
    assert geo.keep_mask_bt.tolist() == [[True, True, True], [False, False, False]]  # 1.587 kept, 1.732 not


def test_weights_are_exactly_one_when_rollout_equals_training():
    old, _, mask = _case()
    old = torch.nan_to_num(old)
    for level in ("token", "sequence", "geometric"):
        result = rollout_correction(old, old.clone(), mask, RolloutCorrectionConfig(
            enable=True, rollout_is=level, rollout_rs=level, rollout_rs_threshold=1.0))
        assert torch.equal(result.weights_bt, mask.double()), level
        assert torch.equal(result.keep_mask_bt, mask), level
        assert result.metrics["rollout_corr/kl"] == 0.0 and result.metrics["rollout_corr/k3_kl"] == 0.0
        assert result.metrics["rollout_corr/is_weight_max"] == 1.0 == result.metrics["rollout_corr/is_weight_min"]


def test_weights_scale_the_policy_loss_value_and_gradient():
    """Token TIS on PPO: per token w * max(-A r, -A clip(r)); only unclipped tokens carry -w A r / N."""
    weights = _correct(rollout_is="token", rollout_is_threshold=1.8).weights_bt  # [[1.8, .5, 1.8], [1, 1.8, 0]]
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = T([[LN(1.5), LN(1.1), LN(0.5)], [0.0, LN(0.9), 0.0]], dtype=torch.float64, requires_grad=True)
    advantages = T([[1.0, 1.0, -1.0], [-2.0, 1.0, 0.0]], dtype=torch.float64)
    mask = _case()[2]
    inputs = ActorLossInputs(logprobs_bt=new, old_logprobs_bt=old, advantages_bt=advantages,
                             response_mask_bt=mask, is_weights_bt=weights)
    loss, metrics = actor_loss(inputs, PolicyLossConfig(clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0),
                               KLConfig(), GlobalCounts(num_tokens=5, num_seqs=2))
    # tokens: (w 1.8, A 1, r 1.5 -> clip 1.2) (w .5, A 1, r 1.1) (w 1.8, A -1, r .5 -> clip .8) (w 1, A -2, r 1)
    #         (w 1.8, A 1, r .9)
    per_token = [1.8 * -1.2, 0.5 * -1.1, 1.8 * 0.8, 1 * 2.0, 1.8 * -0.9]
    assert loss.item() == pytest.approx(sum(per_token) / 5)
    assert metrics.policy.pg_clipfrac.item() == pytest.approx(2 / 5)
    (grad,) = torch.autograd.grad(loss, new)
    expected = T([[0.0, -0.5 * 1.1 / 5, 0.0], [2.0 / 5, -1.8 * 0.9 / 5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)


def test_auto_is_on_exactly_when_the_engine_has_its_own_weights():
    auto = RolloutCorrectionConfig()
    assert auto.resolved(weights_shared=True).active is False
    assert auto.resolved(weights_shared=False).active is True
    assert auto.resolved(weights_shared=False).needs_old_logprobs
    assert RolloutCorrectionConfig(enable=False).resolved(weights_shared=False).active is False
    bypass = RolloutCorrectionConfig(enable=True, rollout_is=None, bypass_mode=True)
    assert bypass.active and not bypass.needs_old_logprobs


def test_bad_config_values():
    with pytest.raises(ConfigError, match=r"^algo.rollout_correction.bypass_mode=true anchors PPO at the rollout "
                                          r"log-probs .*rollout_is has no effect with loss_type=ppo_clip; set "
                                          r"rollout_is null, or loss_type=reinforce"):
        RolloutCorrectionConfig(enable=True, bypass_mode=True)
    with pytest.raises(ConfigError, match=r"rejection band \[3.0, 2.0\] .* needs 0 <= lower <= upper"):
        RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0)
    with pytest.raises(ConfigError, match=r"unknown rollout_correction.rollout_is 'tokn' \(did you mean 'token'\?\)"):
        RolloutCorrectionConfig(rollout_is="tokn")
    with pytest.raises(ConfigError, match=r"rollout_is_threshold=0.0 needs 0 < lower <= upper"):
        RolloutCorrectionConfig(rollout_is_threshold=0.0)
    with pytest.raises(ConfigError, match=r"enable='yes' must be auto, true or false"):
        RolloutCorrectionConfig(enable="yes")


# verl 0.9.1's API. With RATIOS rho = pi_old / pi_rollout, the inverse pi_rollout / pi_old is [.5, 2, .25], [1, 1/3].
def test_k1_bands_bound_pi_rollout_over_pi_old_and_legacy_levels_translate():
    symmetric = _correct(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.4_2.5")
    assert symmetric.keep_mask_bt.tolist() == [[True, True, False], [True, False, False]]
    asymmetric = _correct(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.3_1.5")
    assert asymmetric.keep_mask_bt.tolist() == [[True, False, False], [True, True, False]]
    # the old spelling bounded rho itself: [1/1.5, 1/0.3] on rho is the same band
    legacy = RolloutCorrectionConfig(rollout_is=None, rollout_rs="token", rollout_rs_threshold=1 / 0.3,
                                     rollout_rs_threshold_lower=1 / 1.5)
    assert legacy.rejection_rules() == [RejectionRule(option=RejectionOption.TOKEN_K1, upper=pytest.approx(1.5),
                                                      lower=pytest.approx(0.3))]
    assert _correct(rollout_is=None, rollout_rs="token", rollout_rs_threshold=1 / 0.3,
                    rollout_rs_threshold_lower=1 / 1.5).keep_mask_bt.tolist() == asymmetric.keep_mask_bt.tolist()
    upper_only = RolloutCorrectionConfig(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=2.0)
    assert upper_only.rejection_rules()[0].lower == 0.5  # a single number: lower = 1/upper, as verl
    # rows: prod pi_rollout/pi_old = 1/4 and 1/3
    product = _correct(rollout_is=None, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.3_1.0")
    assert product.keep_mask_bt.tolist() == [[False, False, False], [True, True, False]]


def test_k2_k3_levels_and_chained_options():
    # token k2 = ln^2 rho / 2: .240 .240 .961 | 0 .603
    k2 = _correct(rollout_is=None, rollout_rs="token_k2", rollout_rs_threshold=0.3)
    assert k2.keep_mask_bt.tolist() == [[True, True, False], [True, False, False]]
    # token k3 = rho - 1 - ln rho: .307 .193 1.614 | 0 .901; row max 1.614 | .901; row mean .705 | .450
    seq_max = _correct(rollout_is=None, rollout_rs="seq_max_k3", rollout_rs_threshold=1.0)
    assert seq_max.keep_mask_bt.tolist() == [[False, False, False], [True, True, False]]
    chained = _correct(rollout_is="token", rollout_is_threshold=1.8, rollout_rs="token_k1,seq_mean_k3",
                       rollout_rs_threshold="0.4_2.5,0.7")
    assert chained.keep_mask_bt.tolist() == [[False, False, False], [True, False, False]]
    metrics = chained.metrics
    assert metrics["rollout_corr/rs_token_k1_masked_fraction"] == pytest.approx(2 / 5)
    assert metrics["rollout_corr/rs_seq_mean_k3_masked_fraction"] == pytest.approx(3 / 5)
    assert metrics["rollout_corr/rs_masked_fraction"] == pytest.approx(4 / 5)
    assert chained.weights_bt is not None  # weights and rejection together


def test_icepop_band_zeroes_weights_and_batch_normalisation():
    icepop = _correct(rollout_is="token", rollout_is_threshold="0.6_3.5")
    torch.testing.assert_close(icepop.weights_bt, T([[2.0, 0.0, 0.0], [1.0, 3.0, 0.0]], dtype=torch.float64))
    assert torch.equal(icepop.keep_mask_bt, _case()[2])  # IcePop keeps the tokens in the loss and its counts
    assert icepop.metrics["rollout_corr/is_oob_fraction"] == pytest.approx(2 / 5)
    token = _correct(rollout_is="token", rollout_is_threshold=1.8, rollout_is_batch_normalize=True)
    torch.testing.assert_close(token.weights_bt, T([[1.8, 0.5, 1.8], [1.0, 1.8, 0.0]], dtype=torch.float64) / 1.38)
    assert token.metrics["rollout_corr/is_batch_norm_factor"] == pytest.approx(1.38)
    assert token.metrics["rollout_corr/is_weight_mean"] == pytest.approx(1.38)  # before normalisation, as verl
    rows = _correct(rollout_is="sequence", rollout_is_threshold=3.5, rollout_is_batch_normalize=True)
    torch.testing.assert_close(rows.weights_bt, T([[3.5, 3.5, 3.5], [3.0, 3.0, 0.0]], dtype=torch.float64) / 3.25)


def test_bypass_reinforce_weights_log_pi_by_pi_theta_over_pi_rollout():
    """Bypass: old = rollout; w = min(pi_theta / pi_rollout, 1.8) per token, -A w log pi, no clip."""
    rollout = T([[-1.0, -2.0, -0.5], [-0.3, -1.5, 0.0]], dtype=torch.float64)
    current = (rollout + T([[LN(r) for r in row] for row in RATIOS], dtype=torch.float64)).requires_grad_()
    advantages = T([[1.0, 1.0, -1.0], [-2.0, 1.0, 0.0]], dtype=torch.float64)
    mask = _case()[2]
    inputs = ActorLossInputs(logprobs_bt=current, old_logprobs_bt=rollout, advantages_bt=advantages,
                             response_mask_bt=mask)
    correction = RolloutCorrectionConfig(enable=True, bypass_mode=True, loss_type="reinforce", rollout_is="token",
                                         rollout_is_threshold=1.8, rollout_rs="token_k1",
                                         rollout_rs_threshold="0.3_3.0")  # rejects rho = 4 (1/rho = .25)
    loss, metrics = actor_loss(inputs, PolicyLossConfig(), KLConfig(), GlobalCounts(num_tokens=5, num_seqs=2),
                               correction)
    logp = current.detach()
    weights = [[1.8, 0.5, 0.0], [1.0, 1.8, 0.0]]
    expected = sum(-advantages[i, j].item() * weights[i][j] * logp[i, j].item() for i in range(2) for j in range(3))
    assert loss.item() == pytest.approx(expected / 5)  # the rejected token still counts in the 5 tokens, as verl
    (grad,) = torch.autograd.grad(loss, current)
    torch.testing.assert_close(grad, -advantages * T(weights, dtype=torch.float64) / 5)
    assert metrics.as_dict()["rollout_corr/rs_masked_fraction"].item() == pytest.approx(1 / 5)
    ppo = RolloutCorrectionConfig(enable=True, bypass_mode=True, rollout_is=None, rollout_rs="token_k1",
                                  rollout_rs_threshold="0.3_3.0")
    clipped, _ = actor_loss(inputs, PolicyLossConfig(clip_ratio_c=None), KLConfig(),
                            GlobalCounts(num_tokens=5, num_seqs=2), ppo)
    # PPO at pi_rollout: ratios 2 -> 1.2 (A > 0), .5 (A > 0), [4 rejected], 1 (A < 0), 3 -> 1.2 (A > 0)
    assert clipped.item() == pytest.approx((-1.2 - 0.5 + 2.0 - 1.2) / 5)


def test_verl_api_config_errors():
    with pytest.raises(ConfigError, match=r"rollout_rs='token_k1' needs rollout_rs_threshold"):
        RolloutCorrectionConfig(rollout_rs="token_k1")
    with pytest.raises(ConfigError, match=r"threshold='0.1_0.5' for token_k3 must be a single upper bound"):
        RolloutCorrectionConfig(rollout_rs="token_k3", rollout_rs_threshold="0.1_0.5")
    with pytest.raises(ConfigError, match=r"rollout_rs_threshold_lower belongs to the legacy levels"):
        RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5)
    with pytest.raises(ConfigError, match=r"unknown rollout_correction.rollout_rs option 'seq_mena_k1' \(did you "
                                          r"mean 'seq_mean_k1'\?\)"):
        RolloutCorrectionConfig(rollout_rs="seq_mena_k1", rollout_rs_threshold=2.0)
    with pytest.raises(ConfigError, match=r"gives 2 thresholds for 3 options"):
        RolloutCorrectionConfig(rollout_rs="token_k1,token_k2,seq_max_k3", rollout_rs_threshold="2.0,0.1")
    with pytest.raises(ConfigError, match=r"rollout_rs='sequence' \(legacy level, band on pi_old/pi_rollout\) with "
                                          r"the band '0.5_5.0' is ambiguous: write rollout_rs=seq_sum_k1"):
        RolloutCorrectionConfig(rollout_rs="sequence", rollout_rs_threshold="0.5_5.0")
    with pytest.raises(ConfigError, match=r"mixes the legacy level 'token' with other options"):
        RolloutCorrectionConfig(rollout_rs="token,seq_max_k2", rollout_rs_threshold=2.0)
    with pytest.raises(ConfigError, match=r"rollout_is_threshold='5.0_0.5' needs 0 < lower <= upper"):
        RolloutCorrectionConfig(rollout_is_threshold="5.0_0.5")
    with pytest.raises(ConfigError, match=r"rollout_is_threshold='two' must be a number or a 'lower_upper' band"):
        RolloutCorrectionConfig(rollout_is_threshold="two")
    with pytest.raises(ConfigError, match=r"rollout_is_batch_normalize needs the whole batch's weights"):
        RolloutCorrectionConfig(bypass_mode=True, rollout_is="token", loss_type="reinforce",
                                rollout_is_batch_normalize=True)
    with pytest.raises(ConfigError, match=r"loss_type=reinforce applies in bypass mode only"):
        RolloutCorrectionConfig(loss_type="reinforce")
    with pytest.raises(ConfigError, match=r"unknown rollout_correction.loss_type 'reinforc' \(did you mean "
                                          r"'reinforce'\?\)"):
        RolloutCorrectionConfig(loss_type="reinforc")

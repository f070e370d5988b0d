import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algo.advantages import (AdvantageInputs, compute_advantages, scores_to_token_rewards,
                                  trajectory_advantages)
from rlhf.algo.config import AdvantageConfig
from rlhf.algo.groups import Groups
from rlhf.algo.advantages import AdvantageKind, check_group_size
from rlhf.errors import ConfigError, RewardError, RlhfError

T = torch.tensor


def _mask(lengths, width):
    return (torch.arange(width).unsqueeze(0) < T(lengths).unsqueeze(1)).float()


def _outcome_inputs(scores, lengths, width, groups=None, **kwargs):
    mask = _mask(lengths, width)
    rewards = scores_to_token_rewards(T(scores, dtype=torch.float32), mask)
    return AdvantageInputs(token_rewards_bt=rewards, response_mask_bt=mask, groups=groups, **kwargs)


def test_scores_sit_on_the_last_response_token():
    mask = _mask([2, 3, 0], 3)
    rewards = scores_to_token_rewards(T([1.0, 2.0, 3.0]), mask)
    assert torch.equal(rewards, T([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]))


def test_gae_hand_computed():
    # gamma 0.9, lam 0.8; row 1: deltas 0.04, 0.03, 0.3 -> A = 0.21712, 0.246, 0.3
    # row 2 (last token is padding holding junk): deltas -0.55, 1.5 -> A = 0.53, 1.5
    inputs = AdvantageInputs(token_rewards_bt=T([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]], dtype=torch.float64),
                             values_bt=T([[0.5, 0.6, 0.7], [1.0, 0.5, 99.0]], dtype=torch.float64),
                             response_mask_bt=_mask([3, 2], 3))
    raw = compute_advantages(AdvantageConfig(kind="gae", gamma=0.9, lam=0.8, whiten=False), inputs)
    expected_adv = T([[0.21712, 0.246, 0.3], [0.53, 1.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(raw.advantages_bt, expected_adv)
    torch.testing.assert_close(raw.returns_bt, T([[0.71712, 0.846, 1.0], [1.53, 2.0, 0.0]], dtype=torch.float64))
    whitened = compute_advantages(AdvantageConfig(kind="gae", gamma=0.9, lam=0.8), inputs)
    valid = T([0.21712, 0.246, 0.3, 0.53, 1.5], dtype=torch.float64)
    expected_white = (valid - valid.mean()) / math.sqrt(valid.var().item() + 1e-8)
    torch.testing.assert_close(whitened.advantages_bt[inputs.response_mask_bt.bool()], expected_white)
    assert whitened.advantages_bt[1, 2] == 0.0
    torch.testing.assert_close(whitened.returns_bt, raw.returns_bt)


def test_grpo_hand_computed_and_dr_grpo():
    groups = Groups.from_index(T([7, 7, 7, 7, 3, 3, 9]))
    inputs = _outcome_inputs([1, 0, 0, 1, 2, 2, 5], [2, 3, 1, 3, 3, 2, 3], 3, groups=groups)
    out = compute_advantages(AdvantageConfig(kind="grpo"), inputs)
    z = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # group std (unbiased) of [1, 0, 0, 1] is sqrt(1/3)
    expected_b = T([z, -z, -z, z, 0.0, 0.0, 0.0])  # equal scores -> 0; group of one -> 0
    torch.testing.assert_close(out.advantages_bt, expected_b.unsqueeze(1) * inputs.response_mask_bt)
    dr = compute_advantages(AdvantageConfig(kind="grpo", norm_by_std=False), inputs)
    torch.testing.assert_close(dr.advantages_bt[:, 0], T([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]))


def test_trajectory_advantages_count_each_trajectory_once():
    # group 0: trajectories a (3 rows, score 1), b (score 0), c (score 0); group 1: d (2 rows, score 2), e (score 0);
    # a trajectory's last row (its final turn: what a reward model scores) stands for it, its earlier rows' scores
    # (5, 7) are not read
    groups = Groups.from_index(T([0, 0, 0, 0, 0, 1, 1, 1]))
    trajectory_b = T([0, 0, 0, 1, 2, 0, 0, 1])
    inputs = _outcome_inputs([5, 5, 1, 0, 0, 7, 2, 0], [2, 3, 1, 3, 2, 1, 3, 2], 3, groups=groups)
    once = _outcome_inputs([1, 0, 0, 2, 0], [2, 3, 2, 1, 2], 3, groups=Groups.from_index(T([0, 0, 0, 1, 1])))
    for kind in ("grpo", "rloo"):
        config = AdvantageConfig(kind=kind)
        out = trajectory_advantages(config, inputs, trajectory_b)
        expected_b = compute_advantages(config, once).advantages_bt[:, 0][T([0, 0, 0, 1, 2, 3, 3, 4])]
        assert torch.equal(out.advantages_bt, expected_b.unsqueeze(1) * inputs.response_mask_bt)
    grpo = trajectory_advantages(AdvantageConfig(kind="grpo"), inputs, trajectory_b).advantages_bt
    assert grpo[0, 0] == pytest.approx((2 / 3) / (math.sqrt(1 / 3) + 1e-6))  # scores [1, 0, 0], not [1, 1, 1, 0, 0]
    with pytest.raises(ConfigError, match=r"^algo\.advantage\.kind=gae cannot score trajectories of several rows; "
                                          r"use one of grpo, rloo, gpg, grpo_passk$"):
        trajectory_advantages(AdvantageConfig(kind="gae"), inputs, trajectory_b)


def test_rloo_hand_computed():
    inputs = _outcome_inputs([1, 2, 6, 4], [1, 2, 2, 1], 2, groups=Groups.from_index(T([0, 0, 0, 1])))
    out = compute_advantages(AdvantageConfig(kind="rloo"), inputs)
    torch.testing.assert_close(out.advantages_bt, T([[-3.0, 0.0], [-1.5, -1.5], [4.5, 4.5], [0.0, 0.0]]))


def test_reinforce_plus_plus_hand_computed():
    # gamma 0.5: row 1 returns [1.5, 1, 2]; row 2 returns [2, 4] and the padding reward 7 never leaks in
    inputs = AdvantageInputs(token_rewards_bt=T([[1.0, 0.0, 2.0], [0.0, 4.0, 7.0]]), response_mask_bt=_mask([3, 2], 3))
    out = compute_advantages(AdvantageConfig(kind="reinforce_plus_plus", gamma=0.5), inputs)
    torch.testing.assert_close(out.returns_bt, T([[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]]))
    # whitened over [1.5, 1, 2, 2, 4]: mean 2.1, unbiased var 5.2 / 4 = 1.3
    std = math.sqrt(1.3 + 1e-8)
    torch.testing.assert_close(out.advantages_bt, T([[-0.6, -1.1, -0.1], [-0.1, 1.9, 0.0]]) / std)


def test_reinforce_plus_plus_baseline_hand_computed():
    inputs = _outcome_inputs([1, 3, 0, 4], [2, 2, 2, 2], 2, groups=Groups.contiguous(4, 2))
    out = compute_advantages(AdvantageConfig(kind="reinforce_plus_plus_baseline"), inputs)
    # group-centred [-1, 1, -2, 2] on both tokens; token mean 0, unbiased var 20 / 7
    std = math.sqrt(20 / 7 + 1e-8)
    torch.testing.assert_close(out.advantages_bt, T([[-1.0, -1.0], [1.0, 1.0], [-2.0, -2.0], [2.0, 2.0]]) / std)


def test_remax_hand_computed():
    inputs = AdvantageInputs(token_rewards_bt=T([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]), response_mask_bt=_mask([3, 1], 3),
                             baseline_scores_b=T([1.5, 1.0]))
    out = compute_advantages(AdvantageConfig(kind="remax"), inputs)
    torch.testing.assert_close(out.returns_bt, T([[3.0, 3.0, 2.0], [3.0, 0.0, 0.0]]))
    torch.testing.assert_close(out.advantages_bt, T([[1.5, 1.5, 0.5], [2.0, 0.0, 0.0]]))


def test_all_zero_mask_gives_zeros_not_nan():
    mask = torch.zeros(4, 3)
    for kind in ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]:
        inputs = AdvantageInputs(token_rewards_bt=torch.ones(4, 3), response_mask_bt=mask, values_bt=torch.ones(4, 3),
                                 baseline_scores_b=torch.ones(4), groups=Groups.contiguous(4, 2))
        out = compute_advantages(AdvantageConfig(kind=kind), inputs)
        assert torch.equal(out.advantages_bt, torch.zeros(4, 3)), kind
        assert torch.equal(out.returns_bt, torch.zeros(4, 3)), kind


def test_group_size_not_dividing_batch_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        Groups.contiguous(10, 4)
    assert str(err.value) == ("group size 4 does not divide the batch size 10; "
                              "the batch must hold whole groups of n samples per prompt")


def test_group_baselines_with_one_sample_per_prompt_are_config_errors():
    for kind in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ConfigError) as err:
            check_group_size(AdvantageKind(kind), 1)
        assert str(err.value) == (f"algo.advantage.kind={kind} compares the samples of one prompt, but "
                                  "sampling.n=1 gives each prompt a single sample (every advantage would be 0); "
                                  "set sampling.n >= 2, or use reinforce_plus_plus / gae with n=1")
        check_group_size(AdvantageKind(kind), 2)
    for kind in ("gae", "reinforce_plus_plus", "remax"):
        check_group_size(AdvantageKind(kind), 1)


def test_ppo_is_an_alias_of_gae():
    assert AdvantageConfig(kind="ppo").kind is AdvantageKind.GAE


def test_nan_reward_names_the_sample():
    rewards = torch.zeros(3, 2)
    rewards[2, 0] = float("nan")
    rewards[0, 1] = float("nan")  # padding: ignored
    inputs = AdvantageInputs(token_rewards_bt=rewards, response_mask_bt=_mask([1, 2, 2], 2),
                             groups=Groups.contiguous(3, 3))
    with pytest.raises(RewardError) as err:
        compute_advantages(AdvantageConfig(kind="grpo"), inputs)
    assert str(err.value) == ("token reward is NaN/inf for sample(s) [2]; fix the reward source "
                              "(a non-finite reward must never be silently trained on)")


def test_nan_critic_value_is_reported():
    values = torch.zeros(2, 2)
    values[1, 1] = float("inf")
    inputs = AdvantageInputs(token_rewards_bt=torch.zeros(2, 2), values_bt=values, response_mask_bt=torch.ones(2, 2))
    with pytest.raises(RlhfError, match="critic value is NaN/inf for sample\\(s\\) \\[1\\]; the critic produced"):
        compute_advantages(AdvantageConfig(kind="gae"), inputs)


def test_missing_inputs_are_config_errors():
    inputs = AdvantageInputs(token_rewards_bt=torch.zeros(2, 2), response_mask_bt=torch.ones(2, 2))
    with pytest.raises(ConfigError, match="'gae' needs values_bt of shape \\(2, 2\\)"):
        compute_advantages(AdvantageConfig(kind="gae"), inputs)
    with pytest.raises(ConfigError, match="'remax' needs baseline_scores_b of shape \\(2,\\)"):
        compute_advantages(AdvantageConfig(kind="remax"), inputs)
    with pytest.raises(ConfigError, match="'rloo' needs groups covering the batch of 2"):
        compute_advantages(AdvantageConfig(kind="rloo"), inputs)
    with pytest.raises(ConfigError, match="advantage gamma must be in \\(0, 1\\], got 1.5"):
        AdvantageConfig(kind="gae", gamma=1.5)


@st.composite
def grouped_batches(draw):
    group_size = draw(st.integers(1, 5))
    num_groups = draw(st.integers(1, 4))
    width = draw(st.integers(1, 5))
    batch = group_size * num_groups
    lengths = draw(st.lists(st.integers(1, width), min_size=batch, max_size=batch))
    scores = draw(st.lists(st.floats(-10, 10, allow_nan=False), min_size=batch, max_size=batch))
    return group_size, width, lengths, scores


@settings(max_examples=60, deadline=None)
@given(grouped_batches(), st.booleans())
def test_grpo_advantages_sum_to_zero_per_group(batch, norm_by_std):
    group_size, width, lengths, scores = batch
    inputs = _outcome_inputs(scores, lengths, width, groups=Groups.contiguous(len(scores), group_size))
    adv_b = compute_advantages(AdvantageConfig(kind="grpo", norm_by_std=norm_by_std), inputs).advantages_bt[:, 0]
    sums = adv_b.reshape(-1, group_size).sum(dim=1).double()
    bound = 1e-4 * (1 + T(scores).abs().max().item()) * (group_size if not norm_by_std else 1)
    assert sums.abs().max().item() <= bound


@settings(max_examples=60, deadline=None)
@given(grouped_batches())
def test_rloo_equals_leave_one_out_definition(batch):
    group_size, width, lengths, scores = batch
    inputs = _outcome_inputs(scores, lengths, width, groups=Groups.contiguous(len(scores), group_size))
    adv_b = compute_advantages(AdvantageConfig(kind="rloo"), inputs).advantages_bt[:, 0]
    for i, score in enumerate(scores):
        start = (i // group_size) * group_size
        others = [scores[j] for j in range(start, start + group_size) if j != i]
        expected = score - sum(others) / len(others) if others else 0.0
        assert adv_b[i].item() == pytest.approx(expected, abs=1e-4)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_gae_with_unit_gamma_lambda_is_returns_minus_values(batch, width, data):
    lengths = data.draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    mask = _mask(lengths, width).double()
    rewards = torch.tensor(data.draw(st.lists(st.floats(-5, 5), min_size=batch * width,
                                              max_size=batch * width))).double().reshape(batch, width)
    values = torch.tensor(data.draw(st.lists(st.floats(-5, 5), min_size=batch * width,
                                             max_size=batch * width))).double().reshape(batch, width)
    inputs = AdvantageInputs(token_rewards_bt=rewards, values_bt=values, response_mask_bt=mask)
    out = compute_advantages(AdvantageConfig(kind="gae", gamma=1.0, lam=1.0, whiten=False), inputs)
    returns_to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(out.advantages_bt, (returns_to_go - values) * mask)
    torch.testing.assert_close(out.returns_bt, returns_to_go * mask)

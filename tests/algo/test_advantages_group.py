"""OPO, GPG, GRPO pass@k, GDPO and the optimal token baseline: hand-computed values on small groups."""

import math
import statistics

import pytest
import torch

from rlhf.algo.advantages import AdvantageInputs, check_group_size, compute_advantages, scores_to_token_rewards
from rlhf.algo.config import AdvantageConfig
from rlhf.algo.groups import Groups
from rlhf.errors import ConfigError

T = torch.tensor
F64 = torch.float64
# group 0: rows 0-2 (best score tied), group 1: rows 3-5 (row 4 empty), group 2: row 6 alone
GROUPS = Groups.from_index(T([0, 0, 0, 1, 1, 1, 2]))
SCORES = [1.0, 0.0, 1.0, 2.0, 0.0, 0.5, 3.0]
LENGTHS = [2, 1, 3, 3, 0, 1, 2]


def _mask(lengths, width=3):
    return (torch.arange(width)[None, :] < T(lengths)[:, None]).double()


def _inputs(scores=SCORES, lengths=LENGTHS, groups=GROUPS, **kwargs):
    mask = _mask(lengths)
    return AdvantageInputs(token_rewards_bt=scores_to_token_rewards(T(scores, dtype=F64), mask),
                           response_mask_bt=mask, groups=groups, **kwargs)


def _per_row(advantages_bt, lengths=LENGTHS):
    """Each row's (constant) advantage; None for an empty row, whose tokens are all 0."""
    rows = []
    for row, length in zip(advantages_bt, lengths):
        assert torch.equal(row[length:], torch.zeros_like(row[length:]))
        assert length == 0 or bool((row[:length] == row[0]).all())
        rows.append(None if length == 0 else row[0].item())
    return rows


def test_opo_baseline_is_the_length_weighted_group_mean():
    result = compute_advantages(AdvantageConfig(kind="opo"), _inputs())
    # group 0: (2*1 + 1*0 + 3*1) / 6 = 5/6; group 1: (3*2 + 0 + 1*0.5) / 4 = 1.625; a group of one: 0
    expected = [1 / 6, -5 / 6, 1 / 6, 0.375, None, -1.125, 0.0]
    assert _per_row(result.advantages_bt) == pytest.approx(expected)
    assert torch.equal(result.returns_bt, result.advantages_bt)


def test_gpg_rescales_the_group_centred_score_by_batch_over_rewarded():
    result = compute_advantages(AdvantageConfig(kind="gpg"), _inputs())
    alpha = 7 / 5  # 7 samples, 5 with a non-zero score
    means = [2 / 3] * 3 + [2.5 / 3] * 3 + [3.0]
    expected = [alpha * (s - m) for s, m in zip(SCORES, means)]
    expected[4] = None
    assert _per_row(result.advantages_bt) == pytest.approx(expected)


def test_grpo_passk_rewards_only_the_strict_best_of_each_group():
    result = compute_advantages(AdvantageConfig(kind="grpo_passk"), _inputs())
    std = statistics.stdev([2.0, 0.0, 0.5])
    assert _per_row(result.advantages_bt) == pytest.approx([0.0, 0.0, 0.0, 1.5 / (std + 1e-6), None, 0.0, 0.0])
    dr = compute_advantages(AdvantageConfig(kind="grpo_passk", norm_by_std=False), _inputs())
    assert _per_row(dr.advantages_bt) == pytest.approx([0.0, 0.0, 0.0, 1.5, None, 0.0, 0.0])
    shuffled = Groups.from_index(T([2, 1, 0, 1, 0, 0, 1]))  # groups in any order
    spread = compute_advantages(AdvantageConfig(kind="grpo_passk", norm_by_std=False), _inputs(groups=shuffled))
    # group 0 = rows 2, 4, 5 (scores 1, 0, 0.5): row 2 gets 0.5; group 1 = rows 1, 3, 6 (0, 2, 3): row 6 gets 1
    assert _per_row(spread.advantages_bt) == pytest.approx([0.0, 0.0, 0.5, 0.0, None, 0.0, 1.0])


def _grpo(values, ids):
    out = []
    for value, gid in zip(values, ids):
        members = [v for v, g in zip(values, ids) if g == gid]
        std = statistics.stdev(members) if len(members) > 1 else 0.0
        out.append((value - statistics.mean(members)) / (std + 1e-6))
    return out


def test_gdpo_normalises_each_component_in_its_group_then_whitens_the_weighted_sum():
    second = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 5.0]
    components = T([SCORES, second], dtype=F64).T
    config = AdvantageConfig(kind="gdpo", gdpo_reward_keys=["accuracy", "format"], gdpo_reward_weights=[1.0, 0.5])
    result = compute_advantages(config, _inputs(reward_components_bk=components))
    ids = GROUPS.ids_b.tolist()
    total = [a + 0.5 * b for a, b in zip(_grpo(SCORES, ids), _grpo(second, ids))]
    tokens = [value for value, length in zip(total, LENGTHS) for _ in range(length)]
    mean, var = statistics.mean(tokens), statistics.variance(tokens)
    expected = [(value - mean) / math.sqrt(var + 1e-8) for value in total]
    expected[4] = None
    assert _per_row(result.advantages_bt) == pytest.approx(expected)


def _otb_inputs(weights=None):
    """Group 0: rows 0-1 (row 0 the unique longest); group 1: rows 2-3 (row 2 with an interior zero); row 4 alone.
    pi = 0.5 and sum pi^2 = 0.5 everywhere, so each token adds w = 1 - 2 * 0.5 + 0.5 = 0.5 to W."""
    mask = T([[1, 1, 1], [1, 0, 0], [1, 0, 1], [1, 1, 1], [1, 1, 0]], dtype=F64)
    rewards = scores_to_token_rewards(T([1.0, 0.0, 2.0, 0.0, 3.0], dtype=F64), mask)
    half = torch.full_like(mask, 0.5)
    return AdvantageInputs(token_rewards_bt=rewards, response_mask_bt=mask,
                           groups=Groups.from_index(T([0, 0, 1, 1, 2])), old_logprobs_bt=half.log(),
                           sum_pi_squared_bt=half, is_weights_bt=weights)


def test_optimal_token_baseline_hand_computed():
    result = compute_advantages(AdvantageConfig(kind="optimal_token_baseline"), _otb_inputs())
    eps = 1e-8
    # group 0, t=0: (1 * 0.5 + 0 * 0.5) / 1.0; t >= 1 is row 0's tail (only it has tokens): no baseline
    # group 1, t=0: (2 * 0.5 + 0) / 1.0; t=1: row 3 alone in that column but not past row 2 (no tail): 0 / 1.0;
    #          t=2: (2 * 1.0 + 0 * 1.5) / 2.5; row 4 is a group of one: no baseline
    expected = T([[1 - 0.5 / (1 + eps), 1.0, 1.0], [0 - 0.5 / (1 + eps), 0.0, 0.0],
                  [2 - 1 / (1 + eps), 0.0, 2 - 2 / (2.5 + eps)], [0 - 1 / (1 + eps), 0.0, 0 - 2 / (2.5 + eps)],
                  [3.0, 3.0, 0.0]], dtype=F64)
    torch.testing.assert_close(result.advantages_bt, expected)
    torch.testing.assert_close(result.returns_bt, T([[1.0, 1, 1], [0, 0, 0], [2, 0, 2], [0, 0, 0], [3, 3, 0]],
                                                    dtype=F64))
    weights = torch.ones(5, 3, dtype=F64)
    weights[0, 0] = 2.0  # w * rho^2: row 0's first token weighs 2.0 instead of 0.5
    weighted = compute_advantages(AdvantageConfig(kind="optimal_token_baseline"), _otb_inputs(weights))
    assert weighted.advantages_bt[0, 0].item() == pytest.approx(1 - 2.0 / 2.5)
    assert weighted.advantages_bt[1, 0].item() == pytest.approx(-2.0 / 2.5)


def test_missing_inputs_and_bad_config_are_config_errors():
    with pytest.raises(ConfigError, match=r"'gdpo' normalises each reward component on its own: list them"):
        AdvantageConfig(kind="gdpo")
    with pytest.raises(ConfigError, match=r"gdpo_reward_weights has 1 entries for 2 gdpo_reward_keys"):
        AdvantageConfig(kind="gdpo", gdpo_reward_keys=["a", "b"], gdpo_reward_weights=[1.0])
    config = AdvantageConfig(kind="gdpo", gdpo_reward_keys=["a", "b"])
    with pytest.raises(ConfigError, match=r"'gdpo' needs reward_components_bk of shape \(7, 2\)"):
        compute_advantages(config, _inputs())
    with pytest.raises(ConfigError, match=r"'optimal_token_baseline' needs old_logprobs_bt of shape \(7, 3\)"):
        compute_advantages(AdvantageConfig(kind="optimal_token_baseline"), _inputs())
    with pytest.raises(ConfigError, match=r"'opo' needs groups covering the batch of 7"):
        compute_advantages(AdvantageConfig(kind="opo"), _inputs(groups=None))
    for kind in ["opo", "gpg", "grpo_passk", "optimal_token_baseline"]:
        with pytest.raises(ConfigError, match=rf"algo.advantage.kind={kind} compares the samples of one prompt"):
            check_group_size(AdvantageConfig(kind=kind).kind, 1)


def test_all_zero_mask_gives_zeros():
    lengths = [0] * 7
    for kind in ["opo", "gpg", "grpo_passk"]:
        result = compute_advantages(AdvantageConfig(kind=kind), _inputs(lengths=lengths))
        assert torch.equal(result.advantages_bt, torch.zeros(7, 3, dtype=F64)), kind

"""Dynamic sampling's batch assembly over gathered rounds (pure; the multi-rank run is in test_dapo_run.py)."""

import dataclasses

import torch

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
from fixtures import rollout_batch  # noqa: E402

from rlhf.stages.dynamic_sampling import fill_batch, informative_groups


def _round(scores, tag, n=2):
    """A gathered round: len(scores)/n groups of n rows; tokens carry `tag` so rows can be traced."""
    size = len(scores)
    return rollout_batch(tokens_bs=torch.full((size, 3), tag) + torch.arange(size)[:, None] * 0,
                         prompt_lengths_b=torch.ones(size, dtype=torch.long),
                         response_mask_bt=torch.ones(size, 2, dtype=torch.bool), group_index_b=torch.arange(size) // n,
                         scores_b=torch.tensor(scores))


def test_kept_groups_come_first_in_round_order_renumbered():
    rounds = [_round([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], tag=10), _round([0.0, 1.0, 0.5, 0.0, 1.0, 1.0], tag=20)]
    assert informative_groups(rounds) == 3
    full = fill_batch(rounds, target=3)
    assert full.batch.tokens_bs[:, 0].tolist() == [10, 10, 20, 20, 20, 20]
    assert full.batch.scores_b.tolist() == [1.0, 0.0, 0.0, 1.0, 0.5, 0.0]
    assert full.batch.group_index_b.tolist() == [0, 0, 1, 1, 2, 2]
    assert full.metrics == {"gen_rounds": 2.0, "kept_groups": 3.0, "dropped_groups": 3.0, "filled_groups": 0.0,
                            "kept_fraction": 0.5}


def test_surplus_is_cut_and_a_short_step_is_filled_with_dropped_groups():
    surplus = fill_batch([_round([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], tag=1)], target=1)
    assert surplus.batch.scores_b.tolist() == [1.0, 0.0] and surplus.metrics["kept_groups"] == 1.0
    short = fill_batch([_round([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], tag=1), _round([0.5, 0.5, 0.0, 0.0, 1.0, 1.0], tag=2)],
                       target=3)
    assert short.batch.scores_b.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]  # kept, then round 1's dropped
    assert short.batch.group_index_b.tolist() == [0, 0, 1, 1, 2, 2]
    assert short.metrics["filled_groups"] == 2.0 and short.metrics["kept_groups"] == 1.0


def test_forked_trajectories_are_filtered_by_group_whole():
    """Multi-turn `fork` rows: a trajectory's rows share its score, so a group is informative when its
    trajectories' scores differ, whatever its row count; kept groups keep every row and their trajectory ids, and
    GRPO over the filled batch counts each trajectory once."""
    from rlhf.algo.advantages import AdvantageInputs, scores_to_token_rewards, trajectory_advantages
    from rlhf.algo.config import AdvantageConfig
    from rlhf.algo.groups import Groups

    def forked(scores, groups, trajectories, tag):
        batch = _round(scores, tag)
        return dataclasses.replace(batch, group_index_b=torch.tensor(groups),
                                   trajectory_index_b=torch.tensor(trajectories))

    # round 1: group 0 = a (2 rows, 1.0), b (0.0): informative; group 1 = c (0.5), d (2 rows, 0.5): not
    # round 2: group 0 = e (0.0), f (2 rows, 1.0): informative
    rounds = [forked([1.0, 1.0, 0.0, 0.5, 0.5, 0.5], [0, 0, 0, 1, 1, 1], [0, 0, 1, 0, 1, 1], tag=10),
              forked([0.0, 1.0, 1.0], [0, 0, 0], [0, 1, 1], tag=20)]
    assert informative_groups(rounds) == 2
    full = fill_batch(rounds, target=2)
    batch = full.batch
    assert batch.tokens_bs[:, 0].tolist() == [10, 10, 10, 20, 20, 20]
    assert batch.group_index_b.tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.trajectory_index_b.tolist() == [0, 0, 1, 0, 1, 1]
    assert full.metrics["kept_groups"] == 2.0 and full.metrics["dropped_groups"] == 1.0
    assert batch.trajectory_lengths_b.tolist() == [4, 4, 2, 2, 4, 4]  # each row's response is 2 tokens
    rewards = scores_to_token_rewards(batch.scores_b, batch.response_mask_bt)
    advantages = trajectory_advantages(AdvantageConfig(kind="grpo"), AdvantageInputs(
        token_rewards_bt=rewards, response_mask_bt=batch.response_mask_bt,
        groups=Groups.from_index(batch.group_index_b)), batch.trajectory_index_b).advantages_bt[:, 0]
    one = 0.5 / (0.5 ** 0.5 + 1e-6)  # two trajectories per group, scores {1, 0}: std sqrt(1/2)
    torch.testing.assert_close(advantages, torch.tensor([one, one, -one, -one, one, one]))

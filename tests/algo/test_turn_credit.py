"""Per-turn credit (`multiturn.credit=turn`), hand-computed: returns-to-go, turn numbers across forked rows, and
the outcome estimator run once per (prompt, turn)."""

import torch

from rlhf.algo.advantage_base import AdvantageInputs
from rlhf.algo.config import AdvantageConfig
from rlhf.algo.groups import Groups
from rlhf.algo.turn_credit import turn_advantages, turn_numbers_bt, turn_returns

T = torch.tensor


def test_returns_to_go_are_discounted_and_padded():
    assert turn_returns([1.0, 2.0], 2, 0.5) == [2.0, 2.0]
    assert turn_returns([0.0, 0.0, 4.0], 3, 0.5) == [1.0, 2.0, 4.0]
    assert turn_returns([3.0], 2, 0.5) == [3.0, 0.0] and turn_returns([1.0, 1.0], 1, 0.5) == [1.0]


def test_turn_advantages_group_each_turn_over_the_prompts_trajectories():
    # prompt 0: A (turns 1, 2; rewards 1, 2 -> G = 2, 2) and B (forked: turns 1, 2 in its first row, 3 in its
    # second; rewards 0, 0, 4 -> G = 1, 2, 4); prompt 1: C (one turn, G 1) and D (one turn, G 0); gamma 0.5
    mask = T([[1, 1, 0, 1, 0], [1, 0, 1, 1, 0], [0, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).bool()
    groups, trajectory_b = Groups.from_index(T([0, 0, 0, 1, 1])), T([0, 1, 1, 0, 1])
    turns = turn_numbers_bt(mask, Groups.trajectories(groups.ids_b, trajectory_b))
    assert turns.tolist() == [[1, 1, 0, 2, 0], [1, 0, 2, 2, 0], [0, 3, 3, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    returns = {0: [2.0, 2.0], 1: [1.0, 2.0, 4.0], 3: [1.0], 4: [0.0]}
    returns[2] = returns[1]
    returns_bt = torch.zeros(5, 5)
    for row, values in returns.items():
        for col in range(5):
            if turns[row, col]:
                returns_bt[row, col] = values[turns[row, col] - 1]
    inputs = AdvantageInputs(token_rewards_bt=torch.zeros(5, 5), response_mask_bt=mask, groups=groups)
    grpo = turn_advantages(AdvantageConfig(kind="grpo"), inputs, returns_bt, trajectory_b).advantages_bt
    a = 0.5 / (0.5 ** 0.5 + 1e-6)  # turn 1 of each prompt: two trajectories one apart (unbiased std sqrt(1/2))
    # turn 2 of prompt 0: both G_2 = 2 -> 0; turn 3: B alone (a group of one) -> 0
    expected = T([[a, a, 0, 0, 0], [-a, 0, 0, 0, 0], [0, 0, 0, 0, 0], [a, a, a, 0, 0], [-a, 0, 0, 0, 0]])
    torch.testing.assert_close(grpo, expected)
    rloo = turn_advantages(AdvantageConfig(kind="rloo"), inputs, returns_bt, trajectory_b).advantages_bt
    torch.testing.assert_close(rloo, expected / a)  # G minus the other trajectory's: +-1 on turn 1, 0 after

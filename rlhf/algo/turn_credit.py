"""Per-turn credit inside multi-turn trajectories (`multiturn.credit=turn`), after MT-GRPO's turn-level groups.

A turn is a run of policy-sampled tokens (the loss mask's ones between observation tokens), numbered from 1 over
a trajectory's rows in order. Turn t's tokens are scored by their discounted return-to-go
G_t = sum_{k >= t} gamma^(k - t) r_k, and the outcome estimator runs once per turn number: the group of turn t is
the prompt's trajectories that reached turn t, each counted once with its G_t. Turn 1's score is the whole
discounted return, so turn 1 gets the trajectory's usual advantage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlhf.algo.advantage_base import AdvantageInputs, AdvantageResult
from rlhf.algo.advantages import TRAJECTORY_KINDS, compute_advantages
from rlhf.algo.config import AdvantageConfig
from rlhf.algo.groups import Groups
from rlhf.errors import ConfigError


def turn_returns(turn_rewards: Sequence[float], num_turns: int, discount: float) -> list[float]:
    """G_1..G_num_turns, each turn's discounted return-to-go (turns past the rewards given earned 0)."""
    rewards = list(turn_rewards)[:num_turns] + [0.0] * max(num_turns - len(turn_rewards), 0)
    returns, running = [], 0.0
    for reward in reversed(rewards):
        running = reward + discount * running
        returns.append(running)
    return returns[::-1]


def turn_numbers_bt(loss_mask_bt: Tensor, trajectories: Groups) -> Tensor:
    """int64 [B, T]: each sampled token's turn, 1-based (a trajectory's later rows continue its count), 0 on
    every other token. Rows of one trajectory come in order (as `agents.batch.to_rows` lays them out)."""
    mask_bt = loss_mask_bt.bool()
    before_bt = torch.cat([torch.zeros_like(mask_bt[:, :1]), mask_bt[:, :-1]], dim=1)
    starts_bt = mask_bt & ~before_bt
    runs_b = starts_bt.sum(-1).tolist()
    offsets, seen = [], {}
    for row, trajectory in enumerate(trajectories.ids_b.tolist()):
        offsets.append(seen.get(trajectory, 0))
        seen[trajectory] = offsets[-1] + runs_b[row]
    offset_b = torch.tensor(offsets, dtype=torch.long)
    return (starts_bt.long().cumsum(-1) + offset_b[:, None]) * mask_bt


def turn_advantages(config: AdvantageConfig, inputs: AdvantageInputs, turn_returns_bt: Tensor,
                    trajectory_index_b: Tensor | None) -> AdvantageResult:
    """An outcome estimator per turn number: every (trajectory, turn) is one sample scored by its return-to-go
    (`turn_returns_bt`, constant over the turn's tokens), grouped by (prompt, turn); each turn's tokens get its
    advantage. `trajectory_index_b` None: every row is a trajectory of its own."""
    if config.kind not in TRAJECTORY_KINDS:
        raise ConfigError(f"algo.advantage.kind={config.kind.value} cannot score turns; use one of "
                          f"{', '.join(kind.value for kind in TRAJECTORY_KINDS)} with multiturn.credit=turn")
    assert inputs.groups is not None
    own_b = trajectory_index_b if trajectory_index_b is not None else torch.arange(inputs.groups.ids_b.shape[0])
    trajectories = Groups.trajectories(inputs.groups.ids_b, own_b)
    turns_bt = turn_numbers_bt(inputs.response_mask_bt, trajectories)
    sampled_bt = turns_bt > 0
    rows_n = sampled_bt.nonzero(as_tuple=True)[0]
    width = int(turns_bt.max()) + 1
    samples = Groups.from_index(trajectories.ids_b[rows_n] * width + turns_bt[sampled_bt])
    first_s = torch.full((samples.num_groups,), rows_n.shape[0], dtype=torch.long).scatter_reduce(
        0, samples.ids_b, torch.arange(rows_n.shape[0]), "amin")
    score_s = turn_returns_bt[sampled_bt][first_s].float()
    group_s = inputs.groups.ids_b[rows_n][first_s] * width + turns_bt[sampled_bt][first_s]
    ones_s1 = torch.ones(samples.num_groups, 1, dtype=torch.bool)
    own = compute_advantages(config, AdvantageInputs(token_rewards_bt=score_s[:, None], response_mask_bt=ones_s1,
                                                     groups=Groups.from_index(group_s)))
    advantages_bt = torch.zeros(inputs.response_mask_bt.shape, dtype=inputs.token_rewards_bt.dtype)
    advantages_bt[sampled_bt] = own.advantages_bt[:, 0][samples.ids_b].to(advantages_bt.dtype)
    return AdvantageResult(advantages_bt=advantages_bt, returns_bt=advantages_bt.clone())

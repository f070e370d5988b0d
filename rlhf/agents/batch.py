"""Trajectories as padded training rows: what the rollout side hands to the step's batch.

Rows are right-padded `prompt + response` sequences, as single-turn rows are; `loss_mask_bt` is 1 only on
policy-sampled tokens (interior zeros on tool output and template tokens), `response_mask_bt` on every real
response token. Every row carries its prompt's group and its trajectory (`rollout_index_b`): a forked
trajectory's rows share both, so its reward and advantage are one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.agents.rollout import MultiTurnResult
from rlhf.algo.groups import Groups
from rlhf.algo.turn_credit import turn_numbers_bt, turn_returns
from rlhf.agents.trajectory import Row, Termination, Trajectory

TERMINATIONS = tuple(Termination)


@dataclass(frozen=True, kw_only=True)
class AgentRows:
    tokens_bs: torch.Tensor  # int64 [B, S] prompt + response, right-padded
    prompt_lengths_b: torch.Tensor  # int64 [B]
    response_lengths_b: torch.Tensor  # int64 [B]
    response_mask_bt: torch.Tensor  # bool [B, T] real response tokens (sampled or not)
    loss_mask_bt: torch.Tensor  # bool [B, T] policy-sampled tokens
    rollout_logprobs_bt: torch.Tensor  # fp32 [B, T], 0 where not sampled
    policy_version_bt: torch.Tensor  # int32 [B, T], 0 where not sampled
    group_index_b: torch.Tensor  # int64 [B] the prompt's position in the rollout call
    rollout_index_b: torch.Tensor  # int64 [B] the trajectory (shared by its forked rows; -1: dropped group)
    trajectory_index_b: torch.Tensor  # int64 [B] the trajectory among its group's (shared by its forked rows)
    termination_b: torch.Tensor  # int64 [B] index into TERMINATIONS (-1: a dropped group's row)
    kept_b: torch.Tensor  # bool [B] False on the rows standing in for a dropped group (nothing to train on)
    trajectories: tuple[Trajectory, ...]  # the kept ones, indexed by rollout_index_b

    @property
    def size(self) -> int:
        return self.tokens_bs.shape[0]

    @property
    def truncated_b(self) -> torch.Tensor:
        """Rows whose trajectory ran out of tokens (overlong shaping and filtering read this)."""
        cut = torch.tensor([TERMINATIONS.index(t) for t in (Termination.LENGTH, Termination.TOKEN_BUDGET)])
        return torch.isin(self.termination_b, cut)


def to_rows(result: MultiTurnResult, pad_token_id: int, num_samples: int) -> AgentRows:
    """Every group's trajectories as rows, in group order; a dropped group becomes `num_samples` one-token rows
    with an empty loss mask, so a step's row count never depends on which tools broke."""
    placeholder = Row(tokens=(pad_token_id, pad_token_id), prompt_length=1, loss_mask=(0,), logprobs=(0.0,),
                      versions=(0,))
    rows, groups, rollouts, own, ends, trajectories = [], [], [], [], [], []
    for group_index, group in enumerate(result.groups):
        if group.dropped is not None:
            rows += [placeholder] * num_samples
            groups += [group_index] * num_samples
            rollouts += [-1] * num_samples
            own += list(range(num_samples))
            ends += [-1] * num_samples
            continue
        for sample, trajectory in enumerate(group.trajectories):
            for row in trajectory.rows:
                rows.append(row)
                groups.append(group_index)
                rollouts.append(len(trajectories))
                own.append(sample)
                ends.append(TERMINATIONS.index(trajectory.termination))
            trajectories.append(trajectory)
    width = max([len(row.tokens) for row in rows] + [2])
    response_width = max([len(row.response) for row in rows] + [1])
    tokens = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    shape = (len(rows), response_width)
    response_mask, loss_mask = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
    logprobs, versions = torch.zeros(shape), torch.zeros(shape, dtype=torch.int32)
    for index, row in enumerate(rows):
        length = len(row.response)
        tokens[index, :len(row.tokens)] = torch.tensor(row.tokens)
        response_mask[index, :length] = True
        loss_mask[index, :length] = torch.tensor(row.loss_mask, dtype=torch.bool)
        logprobs[index, :length] = torch.tensor(row.logprobs)
        versions[index, :length] = torch.tensor(row.versions, dtype=torch.int32)
    as_long = lambda values: torch.tensor(values, dtype=torch.long).reshape(-1)  # noqa: E731
    return AgentRows(tokens_bs=tokens, prompt_lengths_b=as_long([r.prompt_length for r in rows]),
                     response_lengths_b=as_long([len(r.response) for r in rows]), response_mask_bt=response_mask,
                     loss_mask_bt=loss_mask, rollout_logprobs_bt=logprobs, policy_version_bt=versions,
                     group_index_b=as_long(groups), rollout_index_b=as_long(rollouts),
                     trajectory_index_b=as_long(own), termination_b=as_long(ends),
                     kept_b=as_long(rollouts) >= 0, trajectories=tuple(trajectories))


def turn_returns_bt(rows: AgentRows, scores_r: torch.Tensor, penalty_b: torch.Tensor, discount: float) -> torch.Tensor:
    """fp32 [B, T] (`multiturn.credit=turn`): each sampled token's turn return-to-go from its trajectory's
    `turn_rewards` (none given: its score `scores_r` is the last turn's reward), plus the row's overlong penalty;
    0 on every other token and on a dropped group's rows."""
    turns_bt = turn_numbers_bt(rows.loss_mask_bt, Groups.from_index(rows.rollout_index_b))
    returns_bt = torch.zeros(rows.loss_mask_bt.shape)
    for row in rows.kept_b.nonzero().squeeze(1).tolist():
        rollout = int(rows.rollout_index_b[row])
        trajectory = rows.trajectories[rollout]
        num_turns = int(turns_bt[rows.rollout_index_b == rollout].max())
        rewards = trajectory.turn_rewards or [0.0] * (num_turns - 1) + [float(scores_r[rollout])]
        returns_t = torch.tensor([0.0] + turn_returns(rewards, num_turns, discount))
        returns_bt[row] = (returns_t[turns_bt[row]] + penalty_b[row]) * rows.loss_mask_bt[row]
    return returns_bt

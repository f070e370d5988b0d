"""Trajectories as padded training rows: what the rollout side hands to the step's batch.

Rows are right-padded `prompt + response` sequences, as single-turn rows are; `loss_mask_bt` is 1 only on
policy-sampled tokens (interior zeros on tool output and template tokens), `response_mask_bt` on every real
response token. Every row carries its prompt's group and its trajectory (`rollout_index_b`): a forked
trajectory's rows share both, so its reward and advantage are one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from rlhf.agents.rollout import MultiTurnResult
from rlhf.agents.trajectory import Termination, Trajectory
from rlhf.data.records import PromptRecord

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
    group_index_b: torch.Tensor  # int64 [B] the prompt (kept groups renumbered 0..G-1)
    rollout_index_b: torch.Tensor  # int64 [B] the trajectory (shared by its forked rows)
    termination_b: torch.Tensor  # int64 [B] index into TERMINATIONS
    records: tuple[PromptRecord, ...]  # per kept group
    trajectories: tuple[Trajectory, ...]  # per rollout index

    @property
    def truncated_b(self) -> torch.Tensor:
        """Rows whose trajectory ran out of tokens (overlong shaping and filtering read this)."""
        cut = torch.tensor([TERMINATIONS.index(t) for t in (Termination.LENGTH, Termination.TOKEN_BUDGET)])
        return torch.isin(self.termination_b, cut)


def to_rows(result: MultiTurnResult, pad_token_id: int) -> AgentRows:
    """The kept groups' trajectories as rows, in group order (dropped groups leave no row)."""
    rows, groups, rollouts, trajectories, records = [], [], [], [], []
    for group in result.kept:
        for trajectory in group.trajectories:
            for row in trajectory.rows:
                rows.append(row)
                groups.append(len(records))
                rollouts.append(len(trajectories))
            trajectories.append(trajectory)
        records.append(group.record)
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
    terminations = [TERMINATIONS.index(trajectories[r].termination) for r in rollouts]
    return AgentRows(tokens_bs=tokens, prompt_lengths_b=torch.tensor([r.prompt_length for r in rows],
                                                                      dtype=torch.long).reshape(-1),
                     response_lengths_b=torch.tensor([len(r.response) for r in rows], dtype=torch.long).reshape(-1),
                     response_mask_bt=response_mask, loss_mask_bt=loss_mask, rollout_logprobs_bt=logprobs,
                     policy_version_bt=versions, group_index_b=torch.tensor(groups, dtype=torch.long).reshape(-1),
                     rollout_index_b=torch.tensor(rollouts, dtype=torch.long).reshape(-1),
                     termination_b=torch.tensor(terminations, dtype=torch.long).reshape(-1),
                     records=tuple(records), trajectories=tuple(trajectories))


def multiturn_metrics(result: MultiTurnResult) -> dict[str, float]:
    """`multiturn/*`: turns, tool calls and errors, forks, prefix mismatches, terminations, dropped groups,
    and the share of the phase the engine sat idle (tools, rendering)."""
    trajectories = [t for group in result.kept for t in group.trajectories]
    count = max(len(trajectories), 1)
    calls = sum(t.num_tool_calls for t in trajectories)
    metrics = {
        "multiturn/turns_mean": sum(t.num_turns for t in trajectories) / count,
        "multiturn/tool_calls_mean": calls / count,
        "multiturn/tool_errors_mean": sum(t.num_tool_errors for t in trajectories) / count,
        "multiturn/forks_mean": sum(t.num_forks for t in trajectories) / count,
        "multiturn/prefix_mismatch": float(sum(t.prefix_mismatches for t in trajectories)),
        "multiturn/dropped_groups": float(sum(group.dropped is not None for group in result.groups)),
        "multiturn/tool_latency_s_mean": sum(t.tool_latency_s for t in trajectories) / count,
        "multiturn/engine_idle_share": result.stats.engine_idle_share,
        "multiturn/generate_calls": float(result.stats.generate_calls),
    }
    ends = Counter(t.termination for t in trajectories)
    for termination in Termination:
        metrics[f"multiturn/termination/{termination.value}"] = ends[termination] / count
    return metrics

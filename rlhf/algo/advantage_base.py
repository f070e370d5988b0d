"""What the advantage estimators share: their inputs and result, the registry, and group / score helpers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.algo.config import AdvantageConfig, AdvantageKind
from rlhf.algo.groups import Groups
from rlhf.algo.registry import Registry


@dataclass(kw_only=True)
class AdvantageInputs:
    """What the estimators read; only GAE needs values, only ReMax baselines, only grouped kinds groups; GDPO
    and the optimal token baseline read their own fields (see `_validate` in advantages.py)."""

    token_rewards_bt: Tensor  # [B, T] float
    response_mask_bt: Tensor  # [B, T] 0/1
    values_bt: Tensor | None = None  # [B, T] critic values (GAE)
    baseline_scores_b: Tensor | None = None  # [B] greedy-rollout scores (ReMax)
    groups: Groups | None = None  # prompt groups (every grouped estimator)
    reward_components_bk: Tensor | None = None  # [B, K] GDPO: one score per gdpo_reward_keys entry
    old_logprobs_bt: Tensor | None = None  # [B, T] optimal token baseline: pi_old of the sampled tokens
    sum_pi_squared_bt: Tensor | None = None  # [B, T] optimal token baseline: sum_v pi_old(v)^2 per position
    is_weights_bt: Tensor | None = None  # [B, T] optimal token baseline: rollout-correction weights, if any


@dataclass(kw_only=True)
class AdvantageResult:
    advantages_bt: Tensor  # [B, T], 0 outside the response mask
    returns_bt: Tensor  # [B, T] value targets (GAE: A + V before whitening), 0 outside the mask


EstimatorFn = Callable[[AdvantageInputs, AdvantageConfig, "dist.ProcessGroup | None"], AdvantageResult]
ADVANTAGE_ESTIMATORS: Registry[AdvantageKind, EstimatorFn] = Registry(AdvantageKind, "advantage estimator")


def sequence_scores_b(inputs: AdvantageInputs) -> Tensor:
    """Per-sequence total reward [B] in float64, summed over response tokens only."""
    mask = inputs.response_mask_bt.bool()
    rewards = inputs.token_rewards_bt.double()
    return torch.where(mask, rewards, torch.zeros_like(rewards)).sum(dim=-1)


def spread(per_seq_b: Tensor, inputs: AdvantageInputs) -> Tensor:
    """A per-sequence value [B] on every response token [B, T], 0 elsewhere, in the rewards' dtype."""
    mask = inputs.response_mask_bt.bool()
    per_seq_b = per_seq_b.to(mask.device)
    values_bt = torch.where(mask, per_seq_b.unsqueeze(-1), torch.zeros_like(per_seq_b).unsqueeze(-1))
    return values_bt.to(inputs.token_rewards_bt.dtype)


def group_normalised_b(scores_b: Tensor, groups: Groups, config: AdvantageConfig) -> Tensor:
    """(score - group mean) / (group std + eps), std unbiased; Dr.GRPO (norm_by_std=false) skips the std."""
    sizes_g = groups.sizes_g(scores_b)
    centered_b = scores_b - groups.broadcast_b(groups.sum_g(scores_b) / sizes_g)
    if config.norm_by_std:
        var_g = groups.sum_g(centered_b.square()) / (sizes_g - 1).clamp(min=1)
        centered_b = centered_b / (groups.broadcast_b(var_g.sqrt()) + config.eps)
    return centered_b


def discounted_returns_bt(rewards_bt: Tensor, mask_bt: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next over response tokens; masked tokens are skipped (hold the running return)."""
    mask = mask_bt.bool()
    rewards = torch.where(mask, rewards_bt, torch.zeros_like(rewards_bt))
    running_b = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running_b = torch.where(mask[:, t], rewards[:, t] + gamma * running_b, running_b)
        returns[:, t] = running_b
    return torch.where(mask, returns, torch.zeros_like(returns))

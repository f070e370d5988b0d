"""Advantage estimators over response-aligned [B, T] tensors, picked by `AdvantageConfig.kind`.

Inputs are per-token rewards (the sequence score sits on the last response token; KL-in-reward penalties on
every token) and a response mask (1 on response tokens, 0 on prompt/padding). Padding never contributes.
Whitening uses statistics over every rank of `dp_group` when given, so DP size does not change the result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.algo import advantages_group, optimal_baseline  # noqa: F401  (importing them registers their estimators)
from rlhf.algo.advantage_base import (ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageResult,
                                      discounted_returns_bt, group_normalised_b, sequence_scores_b, spread)
from rlhf.algo.config import AdvantageConfig, AdvantageKind
from rlhf.algo.groups import Groups
from rlhf.algo.masked import check_finite, masked_whiten
from rlhf.errors import ConfigError, RlhfError


GROUPED_KINDS = (AdvantageKind.GRPO, AdvantageKind.RLOO, AdvantageKind.REINFORCE_PP_BASELINE, AdvantageKind.OPO,
                 AdvantageKind.GPG, AdvantageKind.GRPO_PASSK, AdvantageKind.GDPO, AdvantageKind.OPTIMAL_TOKEN_BASELINE)

# outcome estimators (one advantage per sequence, no whitening): a multi-turn trajectory of several rows gets one
TRAJECTORY_KINDS = (AdvantageKind.GRPO, AdvantageKind.RLOO, AdvantageKind.GPG, AdvantageKind.GRPO_PASSK)


def check_group_size(kind: AdvantageKind, samples_per_prompt: int) -> None:
    """Group baselines need >= 2 samples per prompt: with one, every advantage is exactly 0 and nothing learns."""
    if kind in GROUPED_KINDS and samples_per_prompt < 2:
        raise ConfigError(f"algo.advantage.kind={kind.value} compares the samples of one prompt, but "
                          f"sampling.n={samples_per_prompt} gives each prompt a single sample (every advantage "
                          f"would be 0); set sampling.n >= 2, or use reinforce_plus_plus / gae with n=1")


def compute_advantages(config: AdvantageConfig, inputs: AdvantageInputs, *,
                       dp_group: dist.ProcessGroup | None = None) -> AdvantageResult:
    """Validate inputs (shapes, finiteness, what the estimator needs) and run the configured estimator.

    Collective when `dp_group` is given and the estimator whitens: every rank of the group must call it.
    """
    fn = ADVANTAGE_ESTIMATORS.get(config.kind)
    _validate(config, inputs)
    return fn(inputs, config, dp_group)


def trajectory_advantages(config: AdvantageConfig, inputs: AdvantageInputs,
                          trajectory_index_b: Tensor) -> AdvantageResult:
    """An outcome estimator over trajectories of several rows (multi-turn `fork` history): group statistics
    count each trajectory once (its last row, which holds the final turn, stands for it) and every row of a
    trajectory gets its advantage."""
    if config.kind not in TRAJECTORY_KINDS:
        raise ConfigError(f"algo.advantage.kind={config.kind.value} cannot score trajectories of several rows; use "
                          f"one of {', '.join(kind.value for kind in TRAJECTORY_KINDS)}")
    assert inputs.groups is not None and trajectory_index_b.shape == inputs.groups.ids_b.shape
    trajectories = Groups.trajectories(inputs.groups.ids_b, trajectory_index_b)
    rows_b = torch.arange(trajectory_index_b.shape[0])
    last_r = torch.full((trajectories.num_groups,), -1, dtype=torch.long).scatter_reduce(
        0, trajectories.ids_b, rows_b, "amax")
    mask_rt = inputs.response_mask_bt[last_r]
    own = compute_advantages(config, AdvantageInputs(token_rewards_bt=inputs.token_rewards_bt[last_r],
                                                     response_mask_bt=mask_rt,
                                                     groups=Groups.from_index(inputs.groups.ids_b[last_r])))
    # outcome estimators spread one value over a row's response: read it at its first token (0 if it has none)
    value_r = own.advantages_bt.gather(1, mask_rt.int().argmax(-1, keepdim=True)).squeeze(1)
    advantages = spread(value_r[trajectories.ids_b], inputs)
    return AdvantageResult(advantages_bt=advantages, returns_bt=advantages.clone())


def _validate(config: AdvantageConfig, inputs: AdvantageInputs) -> None:
    kind = config.kind
    shape = tuple(inputs.response_mask_bt.shape)
    if len(shape) != 2 or tuple(inputs.token_rewards_bt.shape) != shape:
        raise ConfigError(f"token_rewards_bt {tuple(inputs.token_rewards_bt.shape)} and response_mask_bt "
                          f"{shape} must both be [B, T]")
    check_finite("token reward", inputs.token_rewards_bt, inputs.response_mask_bt)
    if kind is AdvantageKind.GAE:
        if inputs.values_bt is None or tuple(inputs.values_bt.shape) != shape:
            raise ConfigError(f"advantage estimator 'gae' needs values_bt of shape {shape} (a critic)")
        check_finite("critic value", inputs.values_bt, inputs.response_mask_bt, error=RlhfError,
                     hint="the critic produced non-finite values (diverged?)")
    if kind is AdvantageKind.REMAX:
        if inputs.baseline_scores_b is None or tuple(inputs.baseline_scores_b.shape) != shape[:1]:
            raise ConfigError(f"advantage estimator 'remax' needs baseline_scores_b of shape {shape[:1]} "
                              f"(greedy-rollout scores)")
        check_finite("ReMax baseline score", inputs.baseline_scores_b)
    if kind in GROUPED_KINDS:
        if inputs.groups is None or tuple(inputs.groups.ids_b.shape) != shape[:1]:
            raise ConfigError(f"advantage estimator {kind.value!r} needs groups covering the batch of "
                              f"{shape[0]} (n samples per prompt)")
    if kind is AdvantageKind.GDPO:
        num_keys = len(config.gdpo_reward_keys or [])
        components = inputs.reward_components_bk
        if components is None or tuple(components.shape) != (shape[0], num_keys):
            raise ConfigError(f"advantage estimator 'gdpo' needs reward_components_bk of shape {(shape[0], num_keys)}"
                              f" (one score per gdpo_reward_keys entry: {config.gdpo_reward_keys})")
        check_finite("GDPO reward component", components)
    if kind is AdvantageKind.OPTIMAL_TOKEN_BASELINE:
        for name in ("old_logprobs_bt", "sum_pi_squared_bt"):
            value = getattr(inputs, name)
            if value is None or tuple(value.shape) != shape:
                raise ConfigError(f"advantage estimator 'optimal_token_baseline' needs {name} of shape {shape} "
                                  f"(the actor's old-logprob forward)")
            check_finite(name, value, inputs.response_mask_bt, error=RlhfError, hint="the actor forward diverged?")


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.GAE)
def gae(inputs: AdvantageInputs, config: AdvantageConfig, dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """Generalised advantage estimation; masked tokens are skipped (TD runs between response tokens)."""
    assert inputs.values_bt is not None
    mask = inputs.response_mask_bt.bool()
    rewards = torch.where(mask, inputs.token_rewards_bt, torch.zeros_like(inputs.token_rewards_bt))
    values = torch.where(mask, inputs.values_bt, torch.zeros_like(inputs.values_bt))
    next_value_b = torch.zeros_like(values[:, 0])
    last_gae_b = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta_b = rewards[:, t] + config.gamma * next_value_b - values[:, t]
        gae_b = delta_b + config.gamma * config.lam * last_gae_b
        next_value_b = torch.where(mask[:, t], values[:, t], next_value_b)
        last_gae_b = torch.where(mask[:, t], gae_b, last_gae_b)
        advantages[:, t] = last_gae_b
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    returns = advantages + values
    if config.whiten:
        advantages = masked_whiten(advantages, mask, group=dp_group)
    return AdvantageResult(advantages_bt=advantages, returns_bt=returns)


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.GRPO)
def grpo(inputs: AdvantageInputs, config: AdvantageConfig, dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """(score - group mean) / (group std + eps), std unbiased; Dr.GRPO skips the std. Group of 1 -> 0."""
    assert inputs.groups is not None
    advantages = spread(group_normalised_b(sequence_scores_b(inputs), inputs.groups, config), inputs)
    return AdvantageResult(advantages_bt=advantages, returns_bt=advantages.clone())


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.RLOO)
def rloo(inputs: AdvantageInputs, config: AdvantageConfig, dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """score - mean of the OTHER samples of its group; a group of 1 has no baseline and gets 0."""
    assert inputs.groups is not None
    groups = inputs.groups
    scores_b = sequence_scores_b(inputs)
    sizes_b = groups.broadcast_b(groups.sizes_g(scores_b))
    others_sum_b = groups.broadcast_b(groups.sum_g(scores_b)) - scores_b
    baseline_b = others_sum_b / (sizes_b - 1).clamp(min=1)
    advantage_b = torch.where(sizes_b > 1, scores_b - baseline_b, torch.zeros_like(scores_b))
    advantages = spread(advantage_b, inputs)
    return AdvantageResult(advantages_bt=advantages, returns_bt=advantages.clone())


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.REINFORCE_PP)
def reinforce_plus_plus(inputs: AdvantageInputs, config: AdvantageConfig,
                        dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """Discounted return per token (nothing flows in from after EOS), whitened over the global batch."""
    returns = discounted_returns_bt(inputs.token_rewards_bt, inputs.response_mask_bt, config.gamma)
    advantages = masked_whiten(returns, inputs.response_mask_bt, group=dp_group) if config.whiten else returns
    return AdvantageResult(advantages_bt=advantages, returns_bt=returns)


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.REINFORCE_PP_BASELINE)
def reinforce_plus_plus_baseline(inputs: AdvantageInputs, config: AdvantageConfig,
                                 dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """score - group mean (group of 1 -> 0) on every response token, then whitened over the global batch."""
    assert inputs.groups is not None
    groups = inputs.groups
    scores_b = sequence_scores_b(inputs)
    centered_b = scores_b - groups.broadcast_b(groups.sum_g(scores_b) / groups.sizes_g(scores_b))
    advantages = spread(centered_b, inputs)
    if config.whiten:
        advantages = masked_whiten(advantages, inputs.response_mask_bt, group=dp_group)
    return AdvantageResult(advantages_bt=advantages, returns_bt=advantages.clone())


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.REMAX)
def remax(inputs: AdvantageInputs, config: AdvantageConfig, dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """Undiscounted return-to-go minus the greedy rollout's score (ReMax baseline)."""
    assert inputs.baseline_scores_b is not None
    returns = discounted_returns_bt(inputs.token_rewards_bt, inputs.response_mask_bt, 1.0)
    baseline_bt = spread(inputs.baseline_scores_b.double(), inputs)
    return AdvantageResult(advantages_bt=returns - baseline_bt, returns_bt=returns)


def scores_to_token_rewards(scores_b: Tensor, response_mask_bt: Tensor) -> Tensor:
    """Place each sequence score on its last response token ([B, T], float); empty responses get nothing."""
    mask = response_mask_bt.bool()
    dtype = scores_b.dtype if scores_b.is_floating_point() else torch.float32
    scores_b = scores_b.to(device=mask.device, dtype=dtype)
    positions_bt = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last_b = torch.where(mask, positions_bt, torch.full_like(positions_bt, -1)).amax(dim=-1)
    rewards_bt = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    has_response_b = last_b >= 0
    rows_b = torch.arange(mask.shape[0], device=mask.device)[has_response_b]
    rewards_bt[rows_b, last_b[has_response_b]] = scores_b[has_response_b]
    return rewards_bt

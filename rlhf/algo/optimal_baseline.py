"""Optimal token baseline (arXiv 2602.07078): a per-position group baseline weighted by each path's variance.

B_t = sum_i G_it W_it / sum_i W_it over the group's samples with a response token at t, where G is the return to
go and W_t = sum_{j <= t} (1 - 2 pi_j + sum_v pi(v)^2) (times w_j^2 under rollout-correction weights) is the
cumulative squared score-function norm proxy. A = G - B.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.algo.advantage_base import ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageResult, discounted_returns_bt
from rlhf.algo.config import AdvantageConfig, AdvantageKind
from rlhf.algo.groups import Groups

BASELINE_EPS = 1e-8  # verl's guard on the weight sum


def _tail_bt(mask: Tensor, groups: Groups) -> Tensor:
    """bool [B, T]: positions past every other sample of the group, on the group's unique longest sample.

    There only that sample has a token, so its own return would be its baseline; verl (handle_zero_tail) drops
    the baseline there and rlhf does too. Lengths are the last response position + 1 (interior zeros allowed).
    """
    positions_t = torch.arange(mask.shape[1], device=mask.device)
    ends_b = torch.where(mask, positions_t + 1, torch.zeros_like(positions_t)).amax(dim=-1)
    ids_b = groups.ids_b.to(mask.device)
    longest_g = torch.zeros(groups.num_groups, dtype=ends_b.dtype, device=mask.device).scatter_reduce(
        0, ids_b, ends_b, reduce="amax")
    is_longest_b = ends_b == longest_g[ids_b]
    num_longest_g = groups.sum_g(is_longest_b.long())
    others_b = torch.where(is_longest_b, torch.zeros_like(ends_b), ends_b)
    second_g = torch.zeros_like(longest_g).scatter_reduce(0, ids_b, others_b, reduce="amax")
    unique_b = is_longest_b & (num_longest_g[ids_b] == 1) & (groups.sizes_g(ends_b)[ids_b] > 1)
    return unique_b[:, None] & (positions_t[None, :] >= second_g[ids_b][:, None]) & mask


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.OPTIMAL_TOKEN_BASELINE)
def optimal_token_baseline(inputs: AdvantageInputs, config: AdvantageConfig,
                           dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """G_t - B_t per response token; a group of one sample has no baseline (A = G, as verl)."""
    assert inputs.groups is not None and inputs.old_logprobs_bt is not None
    assert inputs.sum_pi_squared_bt is not None
    groups = inputs.groups
    mask = inputs.response_mask_bt.bool()
    zeros = torch.zeros_like(inputs.token_rewards_bt, dtype=torch.float64)
    returns_bt = discounted_returns_bt(inputs.token_rewards_bt.double(), mask, 1.0)
    step_bt = 1.0 - 2.0 * torch.exp(inputs.old_logprobs_bt.double()) + inputs.sum_pi_squared_bt.double()
    if inputs.is_weights_bt is not None:
        step_bt = step_bt * inputs.is_weights_bt.double().square()
    weight_bt = torch.where(mask, step_bt, zeros).cumsum(dim=-1)
    weight_bt = torch.where(mask, weight_bt, zeros)
    ids_b = groups.ids_b.to(mask.device)
    numerator_gt = zeros.new_zeros(groups.num_groups, mask.shape[1]).index_add_(0, ids_b, returns_bt * weight_bt)
    denominator_gt = zeros.new_zeros(groups.num_groups, mask.shape[1]).index_add_(0, ids_b, weight_bt)
    baseline_bt = (numerator_gt / (denominator_gt + BASELINE_EPS))[ids_b]
    no_baseline_bt = (groups.sizes_g(returns_bt)[ids_b] < 2)[:, None] | _tail_bt(mask, groups)
    baseline_bt = torch.where(no_baseline_bt, zeros, baseline_bt)
    advantages = torch.where(mask, returns_bt - baseline_bt, zeros).to(inputs.token_rewards_bt.dtype)
    return AdvantageResult(advantages_bt=advantages, returns_bt=returns_bt.to(inputs.token_rewards_bt.dtype))

"""Outcome estimators with a group baseline that verl 0.9 registers beside GRPO: OPO, GPG, GRPO pass@k, GDPO.

As rlhf's GRPO, a group of one sample has no baseline and gets advantage 0 (verl: its raw score; pass@k raises).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.algo.advantage_base import (ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageResult, group_normalised_b,
                                      sequence_scores_b, spread)
from rlhf.algo.config import AdvantageConfig, AdvantageKind
from rlhf.algo.groups import Groups
from rlhf.algo.masked import masked_whiten


def _outcome(advantage_b: Tensor, inputs: AdvantageInputs) -> AdvantageResult:
    advantages = spread(advantage_b, inputs)
    return AdvantageResult(advantages_bt=advantages, returns_bt=advantages.clone())


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.OPO)
def opo(inputs: AdvantageInputs, config: AdvantageConfig, dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """score - sum_j |y_j| s_j / sum_j |y_j| over the group (lengths = response tokens); empty group: baseline 0."""
    assert inputs.groups is not None
    groups = inputs.groups
    scores_b = sequence_scores_b(inputs)
    lengths_b = inputs.response_mask_bt.bool().sum(dim=-1).to(scores_b)
    length_sum_g = groups.sum_g(lengths_b)
    baseline_g = torch.where(length_sum_g > 0, groups.sum_g(lengths_b * scores_b) / length_sum_g.clamp(min=1),
                             torch.zeros_like(length_sum_g))
    return _outcome(scores_b - groups.broadcast_b(baseline_g), inputs)


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.GPG)
def gpg(inputs: AdvantageInputs, config: AdvantageConfig, dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """alpha * (score - group mean), alpha = B / #(score != 0) over the global batch (DP-summed when `dp_group`
    is given), so a batch where few samples earn reward is not drowned by zero-advantage groups."""
    assert inputs.groups is not None
    groups = inputs.groups
    scores_b = sequence_scores_b(inputs)
    totals_2 = torch.stack([torch.tensor(float(scores_b.numel()), dtype=torch.float64, device=scores_b.device),
                            (scores_b != 0).sum().double()])
    if dp_group is not None:
        dist.all_reduce(totals_2, op=dist.ReduceOp.SUM, group=dp_group)
    alpha = totals_2[0] / totals_2[1].clamp(min=1)
    centered_b = scores_b - groups.broadcast_b(groups.sum_g(scores_b) / groups.sizes_g(scores_b))
    return _outcome(alpha * centered_b, inputs)


def _best_two_b(scores_b: Tensor, groups: Groups) -> tuple[Tensor, Tensor, Tensor]:
    """(is the group's best sample [B] bool, best score [G], second-best score [G]); ties: the first row is best."""
    rows_b = torch.arange(scores_b.numel(), device=scores_b.device)
    by_score = torch.sort(scores_b, descending=True, stable=True).indices
    order = by_score[torch.sort(groups.ids_b.to(scores_b.device)[by_score], stable=True).indices]
    sizes_g = groups.sizes_g(scores_b).long()
    starts_g = torch.cumsum(sizes_g, dim=0) - sizes_g
    best_rows_g = order[starts_g]
    second_rows_g = order[(starts_g + 1).clamp(max=scores_b.numel() - 1)]
    is_best_b = torch.zeros_like(rows_b, dtype=torch.bool)
    is_best_b[best_rows_g] = True
    second_g = torch.where(sizes_g > 1, scores_b[second_rows_g], scores_b[best_rows_g])
    return is_best_b, scores_b[best_rows_g], second_g


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.GRPO_PASSK)
def grpo_passk(inputs: AdvantageInputs, config: AdvantageConfig,
               dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """Only each group's best sample learns: (r_max - r_second) / (group std + eps) (no std with
    norm_by_std=false); every other sample, a tied best and a group of one get 0."""
    assert inputs.groups is not None
    groups = inputs.groups
    scores_b = sequence_scores_b(inputs)
    is_best_b, best_g, second_g = _best_two_b(scores_b, groups)
    gap_g = best_g - second_g
    if config.norm_by_std:
        sizes_g = groups.sizes_g(scores_b)
        centered_b = scores_b - groups.broadcast_b(groups.sum_g(scores_b) / sizes_g)
        std_g = (groups.sum_g(centered_b.square()) / (sizes_g - 1).clamp(min=1)).sqrt()
        gap_g = gap_g / (std_g + config.eps)
    return _outcome(torch.where(is_best_b, groups.broadcast_b(gap_g), torch.zeros_like(scores_b)), inputs)


@ADVANTAGE_ESTIMATORS.register(AdvantageKind.GDPO)
def gdpo(inputs: AdvantageInputs, config: AdvantageConfig, dp_group: dist.ProcessGroup | None) -> AdvantageResult:
    """sum_k w_k GRPO_k(component k), then whitened over the global batch: each reward component is normalised
    within its group before they are added, so a dominant one cannot drown the rest. As verl, the token rewards
    (and so a KL-in-reward penalty) do not enter: the components are the signal."""
    assert inputs.groups is not None and inputs.reward_components_bk is not None
    components_bk = inputs.reward_components_bk.double()
    weights_k = config.gdpo_reward_weights or [1.0] * components_bk.shape[1]
    total_b = torch.zeros_like(components_bk[:, 0])
    for k, weight in enumerate(weights_k):
        total_b = total_b + weight * group_normalised_b(components_bk[:, k], inputs.groups, config)
    advantages = masked_whiten(spread(total_b, inputs), inputs.response_mask_bt, group=dp_group)
    return AdvantageResult(advantages_bt=advantages, returns_bt=advantages.clone())

"""DAPO's data-side pieces (Yu et al. 2025), as pure functions with their config (verl's names).

Dynamic sampling (`filter_groups`): groups whose rewards are all equal carry no GRPO signal and are dropped;
the trainer generates more rounds until the batch is full. Overlong reward shaping (`overlong_buffer`): a
linear penalty from 0 to -penalty_factor over the last `len` tokens before the max length. Overlong filtering
(`overlong_filter`): truncated responses leave the loss (the trainer masks them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algo.config import OverlongBufferConfig
from rlhf.algo.groups import Groups


def overlong_penalty(response_lengths_b: Tensor, max_length: int, config: OverlongBufferConfig) -> Tensor:
    """fp32 [B] reward penalty: 0 up to max_length - len, then -factor * (excess / len), capped at -factor."""
    if config.len == 0:
        return torch.zeros(response_lengths_b.shape, dtype=torch.float32)
    excess_b = (response_lengths_b - (max_length - config.len)).clamp(min=0).float()
    return -config.penalty_factor * (excess_b / config.len).clamp(max=1.0)


def informative_rows(scores_b: Tensor, group_index_b: Tensor) -> Tensor:
    """bool [B]: rows of groups whose scores are not all equal (the groups dynamic sampling keeps)."""
    groups = Groups.from_index(group_index_b)
    ids = groups.ids_b
    high_g = torch.full((groups.num_groups,), -torch.inf, dtype=scores_b.dtype).scatter_reduce(
        0, ids, scores_b, reduce="amax")
    low_g = torch.full((groups.num_groups,), torch.inf, dtype=scores_b.dtype).scatter_reduce(
        0, ids, scores_b, reduce="amin")
    return groups.broadcast_b(high_g > low_g)

"""Which prompt group each sample belongs to, for group-baselined estimators (GRPO, RLOO, REINFORCE++-baseline).

Groups must be whole on each rank. The trainer lays out the n samples of a prompt contiguously and should use
`Groups.contiguous(batch_size, n)`; `Groups.from_index` accepts arbitrary uids (e.g. after filtering).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Groups:
    """Dense group ids 0..num_groups-1 per sample."""

    ids_b: Tensor  # int64 [B]
    num_groups: int

    @classmethod
    def contiguous(cls, batch_size: int, group_size: int) -> Groups:
        """Samples [k*n, (k+1)*n) form group k."""
        if group_size < 1 or batch_size % group_size != 0:
            raise ConfigError(f"group size {group_size} does not divide the batch size {batch_size}; "
                              f"the batch must hold whole groups of n samples per prompt")
        ids_b = torch.arange(batch_size, dtype=torch.int64) // group_size
        return cls(ids_b=ids_b, num_groups=batch_size // group_size)

    @classmethod
    def from_index(cls, group_index_b: Tensor) -> Groups:
        """Samples sharing a uid (any integer tensor [B]) form a group, in any order."""
        if group_index_b.dim() != 1 or group_index_b.dtype.is_floating_point:
            raise ConfigError(f"group_index_b must be a 1-D integer tensor, got shape "
                              f"{tuple(group_index_b.shape)} dtype {group_index_b.dtype}")
        uniques, ids_b = torch.unique(group_index_b, return_inverse=True)
        return cls(ids_b=ids_b.to(torch.int64), num_groups=int(uniques.numel()))

    @classmethod
    def trajectories(cls, group_index_b: Tensor, trajectory_index_b: Tensor) -> Groups:
        """Rows sharing (group, trajectory in it) form one: the rows of a forked multi-turn trajectory."""
        keys_b = (cls.from_index(group_index_b).ids_b * (int(trajectory_index_b.max()) + 1)
                  + trajectory_index_b.to(torch.int64))
        return cls.from_index(keys_b)

    def sum_g(self, x_b: Tensor) -> Tensor:
        """Per-group sums [G] of a per-sample tensor [B]."""
        return torch.zeros(self.num_groups, dtype=x_b.dtype, device=x_b.device).index_add_(
            0, self.ids_b.to(x_b.device), x_b)

    def sizes_g(self, like: Tensor) -> Tensor:
        """Samples per group [G], in `like`'s dtype and device."""
        return self.sum_g(torch.ones(self.ids_b.shape[0], dtype=like.dtype, device=like.device))

    def broadcast_b(self, x_g: Tensor) -> Tensor:
        """Per-group values [G] back to per-sample [B]."""
        return x_g[self.ids_b.to(x_g.device)]

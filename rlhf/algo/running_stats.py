"""Running mean/variance of a scalar stream (Welford / Chan et al. merge), mergeable across ranks.

Used to normalise rewards (`rlhf replay`). Stats are kept in float64; `state()` is a [3] tensor
(count, mean, M2) that ranks all_gather and merge, or `sync(group)` does exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.algo.masked import check_finite
from rlhf.platform import current_device


@dataclass(kw_only=True)
class RunningMeanStd:
    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations from the mean

    @property
    def var(self) -> float:
        """Population variance (0 until two values were seen)."""
        return self.m2 / self.count if self.count > 1 else 0.0

    @property
    def std(self) -> float:
        return self.var ** 0.5

    def update(self, values: Tensor) -> None:
        """Fold in a batch of values (any shape); NaN/inf raises RewardError naming the rows."""
        flat = values.detach().reshape(-1, 1) if values.dim() < 2 else values.detach()
        check_finite("value for RunningMeanStd", flat)
        batch = flat.double().flatten()
        if batch.numel() == 0:
            return
        batch_mean = float(batch.mean())
        batch_m2 = float((batch - batch_mean).square().sum())
        self.merge(RunningMeanStd(count=float(batch.numel()), mean=batch_mean, m2=batch_m2))

    def merge(self, other: RunningMeanStd) -> None:
        """Combine with stats of a disjoint stream (Chan's parallel formula), in place."""
        total = self.count + other.count
        if total == 0:
            return
        delta = other.mean - self.mean
        self.mean += delta * other.count / total
        self.m2 += other.m2 + delta * delta * self.count * other.count / total
        self.count = total

    def normalize(self, values: Tensor, *, center: bool = True, eps: float = 1e-8) -> Tensor:
        """(values - mean) / std, or values / std with center=False, in the values' dtype."""
        shifted = values.double() - self.mean if center else values.double()
        return (shifted / (self.std + eps)).to(values.dtype)

    def state(self) -> Tensor:
        """[3] float64 (count, mean, M2) for checkpoints and all_gather."""
        return torch.tensor([self.count, self.mean, self.m2], dtype=torch.float64)

    @classmethod
    def from_state(cls, state_3: Tensor) -> RunningMeanStd:
        count, mean, m2 = (float(v) for v in state_3.double().tolist())
        return cls(count=count, mean=mean, m2=m2)

    @classmethod
    def merged(cls, states_n3: Tensor) -> RunningMeanStd:
        """Merge N stacked states [N, 3] (e.g. one per rank from all_gather) in order."""
        total = cls()
        for state_3 in states_n3:
            total.merge(cls.from_state(state_3))
        return total

    def sync(self, group: dist.ProcessGroup | None = None) -> RunningMeanStd:
        """Stats over every rank's stream (collective): all_gather the states and merge them in rank order."""
        device = current_device()
        gathered = [torch.zeros(3, dtype=torch.float64, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, self.state().to(device), group=group)
        return self.merged(torch.stack(gathered).cpu())

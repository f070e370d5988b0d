"""Masked reductions over [B, T] tensors; empty masks give 0, never NaN; optional global stats over a group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.errors import RewardError, RlhfError


def _all_reduce_sum(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def masked_mean_var(x_bt: Tensor, mask_bt: Tensor, *,
                    group: dist.ProcessGroup | None = None) -> tuple[Tensor, Tensor]:
    """float64 (mean, unbiased variance) of the masked entries over every rank of `group` when given.

    Two passes for accuracy (collective when `group` is given); the variance is 0 below two entries.
    """
    mask = mask_bt.bool()
    x64 = torch.where(mask, x_bt, torch.zeros_like(x_bt)).double()
    sum_count = _all_reduce_sum(torch.stack([x64.sum(), mask.sum().double()]), group)
    count = sum_count[1]
    mean = sum_count[0] / count.clamp(min=1)
    centered = torch.where(mask, x64 - mean, torch.zeros_like(x64))
    sq_sum = _all_reduce_sum(centered.square().sum().reshape(1), group)[0]
    var = torch.where(count > 1, sq_sum / (count - 1).clamp(min=1), torch.zeros_like(sq_sum))
    return mean, var


def masked_whiten(x_bt: Tensor, mask_bt: Tensor, *, group: dist.ProcessGroup | None = None,
                  shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (stats over `group` when given); 0 off the mask."""
    mask = mask_bt.bool()
    mean, var = masked_mean_var(x_bt, mask, group=group)
    whitened = (x_bt.double() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened)).to(x_bt.dtype)


def check_finite(name: str, x: Tensor, mask: Tensor | None = None, *, error: type[RlhfError] = RewardError,
                 hint: str = "fix the reward source (a non-finite reward must never be silently trained on)") -> None:
    """Raise `error` naming the samples (batch rows) where `x` is NaN/inf under `mask`."""
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & mask.bool()
    if bool(bad.any()):
        rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        more = f" and {len(rows) - 8} more" if len(rows) > 8 else ""
        raise error(f"{name} is NaN/inf for sample(s) {rows[:8]}{more}; {hint}")

"""Clipped value (critic) loss and the explained-variance metric over [B, T] tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.algo.aggregation import GlobalCounts, aggregate_loss
from rlhf.algo.config import ValueLossConfig
from rlhf.algo.masked import masked_mean_var


@dataclass(kw_only=True)
class ValueLossMetrics:
    """Detached partial sums (reduce: sum over micro-batches and DP ranks)."""

    vf_loss: Tensor
    vf_clipfrac: Tensor  # fraction of tokens where the clipped error was the larger
    vpred_mean: Tensor  # token-mean of the predicted values

    def as_dict(self, prefix: str = "critic/") -> dict[str, Tensor]:
        return {f"{prefix}{name}": value for name, value in vars(self).items()}


def value_loss(values_bt: Tensor, old_values_bt: Tensor, returns_bt: Tensor, response_mask_bt: Tensor,
               config: ValueLossConfig, counts: GlobalCounts) -> tuple[Tensor, ValueLossMetrics]:
    """0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2), aggregated; masked tokens never contribute."""
    mask = response_mask_bt.bool()
    errors_bt = torch.where(mask, values_bt - returns_bt, torch.zeros_like(values_bt))
    losses_bt = errors_bt.square()
    clip_active_bt = torch.zeros_like(mask)
    if config.clip_range_value is not None:
        clipped_bt = torch.clamp(values_bt, old_values_bt - config.clip_range_value,
                                 old_values_bt + config.clip_range_value)
        clipped_losses_bt = torch.where(mask, clipped_bt - returns_bt, torch.zeros_like(values_bt)).square()
        clip_active_bt = mask & (clipped_losses_bt > losses_bt)
        losses_bt = torch.maximum(losses_bt, clipped_losses_bt)
    loss = 0.5 * aggregate_loss(losses_bt, mask, mode=config.agg, counts=counts,
                                norm_length=config.agg_norm_length)
    num_tokens = max(counts.num_tokens, 1)
    metrics = ValueLossMetrics(
        vf_loss=loss.detach(), vf_clipfrac=clip_active_bt.sum().double() / num_tokens,
        vpred_mean=torch.where(mask, values_bt.detach(), torch.zeros_like(values_bt)).sum().double() / num_tokens)
    return loss, metrics


def explained_variance(values_bt: Tensor, returns_bt: Tensor, response_mask_bt: Tensor, *,
                       group: dist.ProcessGroup | None = None, eps: float = 1e-8) -> Tensor:
    """1 - Var[R - V] / Var[R] over response tokens (of every rank of `group`); 1 is a perfect critic."""
    _, residual_var = masked_mean_var(returns_bt - values_bt, response_mask_bt, group=group)
    _, returns_var = masked_mean_var(returns_bt, response_mask_bt, group=group)
    return 1.0 - residual_var / (returns_var + eps)

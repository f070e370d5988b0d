"""Rollout correction: importance weights and rejection masks for rollout != training numerics (verl's names).

Tokens are sampled by the rollout engine (pi_rollout) but the loss anchors at the actor's old policy (pi_old):
    rho_t = pi_old(t) / pi_rollout(t), from the [B, T] log-probs of both, on response tokens only.
  IS weight (`rollout_is`), multiplies each token's policy loss, detached, truncated at `rollout_is_threshold`:
    token: rho_t (TIS) · sequence: prod_t rho_t · geometric: exp(mean_t log rho_t), broadcast over the row.
  Rejection (`rollout_rs`): tokens / rows whose ratio at that level leaves [lower, upper] leave the loss
    (token + a two-sided band = IcePop; sequence = seq-MIS).
Decoupled mode: three policies (PPO ratio pi/pi_old, weights pi_old/pi_rollout). Bypass: pi_old := pi_rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algo.config import CorrectionLevel, RolloutCorrectionConfig

LOG_RATIO_BOUND = 20.0  # safety bound on log rho at every level: weights stay in [exp(-20), exp(20)]


@dataclass(kw_only=True)
class RolloutCorrection:
    """Weights (detached fp32 [B, T], 0 off the response; None without `rollout_is`), the tokens kept in the
    loss (bool [B, T]) and global-batch metrics under `rollout_corr/`."""

    weights_bt: Tensor | None
    keep_mask_bt: Tensor
    metrics: dict[str, float]


def _level_log_ratio(log_ratio_bt: Tensor, mask_bt: Tensor, level: CorrectionLevel) -> Tensor:
    """log rho at `level`, broadcast to [B, T] and safety-bounded."""
    if level is CorrectionLevel.TOKEN:
        level_bt = log_ratio_bt
    else:
        seq_b = log_ratio_bt.sum(dim=-1)
        if level is CorrectionLevel.GEOMETRIC:
            seq_b = seq_b / mask_bt.sum(dim=-1).clamp(min=1)
        level_bt = seq_b[:, None].expand_as(log_ratio_bt)
    return level_bt.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def rollout_correction(old_logprobs_bt: Tensor, rollout_logprobs_bt: Tensor, response_mask_bt: Tensor,
                       config: RolloutCorrectionConfig) -> RolloutCorrection:
    """Weights, kept tokens and metrics of one whole (global) batch; pure, no gradient."""
    mask = response_mask_bt.bool()
    zeros = torch.zeros_like(old_logprobs_bt, dtype=torch.float64)
    log_ratio_bt = torch.where(mask, old_logprobs_bt.double() - rollout_logprobs_bt.double(), zeros)
    num_tokens = max(int(mask.sum()), 1)
    weights_bt, truncated_bt = None, torch.zeros_like(mask)
    if config.rollout_is is not None:
        raw_bt = torch.exp(_level_log_ratio(log_ratio_bt, mask, config.rollout_is))
        truncated_bt = mask & (raw_bt > config.rollout_is_threshold)
        weights_bt = torch.where(mask, raw_bt.clamp(max=config.rollout_is_threshold), zeros)
    keep_bt = mask
    if config.rollout_rs is not None:
        upper, lower = config.rs_bounds
        ratio_bt = torch.exp(_level_log_ratio(log_ratio_bt, mask, config.rollout_rs))
        keep_bt = mask & (ratio_bt >= lower) & (ratio_bt <= upper)
    k3_bt = torch.where(mask, torch.expm1(log_ratio_bt) - log_ratio_bt, zeros)
    metrics = {"kl": float(-log_ratio_bt.sum()) / num_tokens, "k3_kl": float(k3_bt.sum()) / num_tokens,
               "log_ratio_abs_max": float(log_ratio_bt.abs().max()) if mask.any() else 0.0,
               "rs_masked_fraction": float((mask & ~keep_bt).sum()) / num_tokens}
    if weights_bt is not None:
        metrics |= {"is_weight_mean": float(weights_bt.sum()) / num_tokens,
                    "is_weight_max": float(weights_bt[mask].max()) if mask.any() else 0.0,
                    "is_weight_min": float(weights_bt[mask].min()) if mask.any() else 0.0,
                    "is_truncated_fraction": float(truncated_bt.sum()) / num_tokens}
        weights_bt = weights_bt.to(old_logprobs_bt.dtype)
    return RolloutCorrection(weights_bt=weights_bt, keep_mask_bt=keep_bt,
                             metrics={f"rollout_corr/{name}": value for name, value in metrics.items()})

"""Rollout correction: importance weights and rejection masks for rollout != training numerics (verl 0.9.1's API).

Tokens are sampled by the rollout engine (pi_rollout); log rho_t = log pi_old(t) - log pi_rollout(t) on response
tokens (bypass mode: pi_theta in place of pi_old, per micro-batch inside the actor's loss).
  IS weight (`rollout_is`), detached, multiplies each token's policy loss: token rho_t (TIS) · sequence
    prod_t rho_t · geometric exp(mean_t log rho_t), broadcast over the row; a number threshold truncates it, a
    "lower_upper" band zeroes it outside the band (IcePop); optionally divided by its global-batch mean.
  Rejection (`rollout_rs`): every listed option must pass, else the token (token_*) or row (seq_*) leaves the
    loss: k1 = -log rho in [log lower, log upper] (a band on pi_rollout/pi_old), k2 = log^2 rho / 2 and
    k3 = rho - 1 - log rho at most `upper`; seq_sum / seq_mean / seq_max reduce the token statistic per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algo.correction_config import CorrectionLevel, RejectionRule, RolloutCorrectionConfig

LOG_RATIO_BOUND = 20.0  # safety bound on log rho at every level: weights stay in [exp(-20), exp(20)]
BATCH_NORM_MIN = 1e-8  # below this mean weight, batch normalisation is skipped (verl's guard)


@dataclass(frozen=True, kw_only=True)
class RolloutCorrection:
    """Weights (detached [B, T] in the log-probs' dtype, 0 off the response; None without `rollout_is`), the tokens
    kept in the loss (bool [B, T]) and global-batch metrics under `rollout_corr/`."""

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


def _rule_keep(log_ratio_bt: Tensor, mask: Tensor, rule: RejectionRule) -> Tensor:
    """bool [B, T]: the tokens one rejection option keeps (rows broadcast for seq_* options)."""
    safe_bt = log_ratio_bt.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    estimator = rule.option.value[-2:]
    token_bt = {"k1": -safe_bt, "k2": 0.5 * safe_bt.square(), "k3": torch.expm1(safe_bt) - safe_bt}[estimator]
    token_bt = torch.where(mask, token_bt, torch.zeros_like(token_bt))
    level = rule.option.value[:-3]
    if level == "token":
        stat_bt = token_bt
    elif level == "seq_max":
        stat_bt = torch.where(mask, token_bt, torch.full_like(token_bt, -math.inf)).amax(dim=-1).clamp(min=0.0)
        stat_bt = stat_bt[:, None].expand_as(token_bt)
    else:
        stat_b = token_bt.sum(dim=-1)
        if level == "seq_mean":
            stat_b = stat_b / mask.sum(dim=-1).clamp(min=1)
        stat_bt = stat_b[:, None].expand_as(token_bt)
    if estimator == "k1":
        assert rule.lower is not None
        return (stat_bt >= math.log(rule.lower)) & (stat_bt <= math.log(rule.upper))
    return stat_bt <= rule.upper


def correction_tensors(log_ratio_bt: Tensor, mask: Tensor,
                       config: RolloutCorrectionConfig) -> tuple[Tensor | None, Tensor | None, Tensor, list[Tensor]]:
    """(weights float64 or None, raw weights or None, kept tokens, each option's kept tokens); no metrics."""
    zeros = torch.zeros_like(log_ratio_bt)
    weights_bt = raw_bt = None
    if config.rollout_is is not None:
        upper, lower = config.is_band()
        raw_bt = torch.exp(_level_log_ratio(log_ratio_bt, mask, config.rollout_is))
        if lower is None:
            weights_bt = torch.where(mask, raw_bt.clamp(max=upper), zeros)
        else:
            weights_bt = torch.where(mask & (raw_bt >= lower) & (raw_bt <= upper), raw_bt, zeros)
    option_keeps = [_rule_keep(log_ratio_bt, mask, rule) & mask for rule in config.rejection_rules()]
    keep_bt = mask
    for option_keep_bt in option_keeps:
        keep_bt = keep_bt & option_keep_bt
    return weights_bt, raw_bt, keep_bt, option_keeps


def _batch_normalised(weights_bt: Tensor, mask: Tensor, level: CorrectionLevel) -> tuple[Tensor, float]:
    """Weights divided by their mean over the batch's tokens (token level) or non-empty rows (row levels)."""
    if level is CorrectionLevel.TOKEN:
        mean = weights_bt.sum() / mask.sum().clamp(min=1)
    else:
        rows_b = mask.any(dim=-1)
        row_weight_b = weights_bt.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        mean = row_weight_b[rows_b].sum() / rows_b.sum().clamp(min=1)
    factor = float(mean) if float(mean) > BATCH_NORM_MIN else 1.0
    return weights_bt / factor, factor


def rollout_correction(old_logprobs_bt: Tensor, rollout_logprobs_bt: Tensor, response_mask_bt: Tensor,
                       config: RolloutCorrectionConfig) -> RolloutCorrection:
    """Weights, kept tokens and metrics of one whole (global) batch; pure, no gradient."""
    mask = response_mask_bt.bool()
    zeros = torch.zeros_like(old_logprobs_bt, dtype=torch.float64)
    log_ratio_bt = torch.where(mask, old_logprobs_bt.double() - rollout_logprobs_bt.double(), zeros)
    num_tokens = max(int(mask.sum()), 1)
    weights_bt, raw_bt, keep_bt, option_keeps = correction_tensors(log_ratio_bt, mask, config)
    k3_bt = torch.where(mask, torch.expm1(log_ratio_bt) - log_ratio_bt, zeros)
    metrics = {"kl": float(-log_ratio_bt.sum()) / num_tokens, "k3_kl": float(k3_bt.sum()) / num_tokens,
               "log_ratio_abs_max": float(log_ratio_bt.abs().max()) if mask.any() else 0.0,
               "rs_masked_fraction": float((mask & ~keep_bt).sum()) / num_tokens}
    for rule, option_keep_bt in zip(config.rejection_rules(), option_keeps):
        metrics[f"rs_{rule.option.value}_masked_fraction"] = float((mask & ~option_keep_bt).sum()) / num_tokens
    if weights_bt is not None:
        assert raw_bt is not None and config.rollout_is is not None
        upper, lower = config.is_band()
        out_bt = mask & (raw_bt > upper) if lower is None else mask & ((raw_bt < lower) | (raw_bt > upper))
        metrics |= {"is_weight_mean": float(weights_bt.sum()) / num_tokens,
                    "is_weight_max": float(weights_bt[mask].max()) if mask.any() else 0.0,
                    "is_weight_min": float(weights_bt[mask].min()) if mask.any() else 0.0,
                    ("is_truncated_fraction" if lower is None else "is_oob_fraction"): float(out_bt.sum()) / num_tokens}
        if config.rollout_is_batch_normalize:
            weights_bt, metrics["is_batch_norm_factor"] = _batch_normalised(weights_bt, mask, config.rollout_is)
        weights_bt = weights_bt.to(old_logprobs_bt.dtype)
    return RolloutCorrection(weights_bt=weights_bt, keep_mask_bt=keep_bt,
                             metrics={f"rollout_corr/{name}": value for name, value in metrics.items()})


def in_loss_correction(logprobs_bt: Tensor, rollout_logprobs_bt: Tensor, response_mask_bt: Tensor,
                       config: RolloutCorrectionConfig) -> tuple[Tensor | None, Tensor]:
    """Bypass mode, per micro-batch: (detached weights of pi_theta / pi_rollout or None, kept tokens)."""
    mask = response_mask_bt.bool()
    log_ratio_bt = torch.where(mask, logprobs_bt.detach().double() - rollout_logprobs_bt.double(),
                               torch.zeros_like(logprobs_bt, dtype=torch.float64))
    weights_bt, _, keep_bt, _ = correction_tensors(log_ratio_bt, mask, config)
    return (None if weights_bt is None else weights_bt.to(logprobs_bt.dtype)), keep_bt

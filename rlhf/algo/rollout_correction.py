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

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

import torch
from torch import Tensor

from rlhf.algo.registry import parse_kind
from rlhf.errors import ConfigError

LOG_RATIO_BOUND = 20.0  # safety bound on log rho at every level: weights stay in [exp(-20), exp(20)]


class CorrectionLevel(StrEnum):
    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """`enable`: auto = on exactly when the rollout engine does not generate with the actor's own parameter
    tensors (a resharded copy, another dtype, vllm/hf), whose numerics differ; there the default is token TIS
    at 2 (verl's). Both levels null with enable=true: metrics only. `bypass_mode`: the rollout log-probs are the
    PPO anchor (no old-logprob forward); the clipped ratio pi/pi_rollout is then the correction.
    `rollout_rs_threshold` defaults to `rollout_is_threshold`, `rollout_rs_threshold_lower` to 1/upper."""

    enable: bool | Literal["auto"] = "auto"
    rollout_is: CorrectionLevel | None = CorrectionLevel.TOKEN
    rollout_is_threshold: float = 2.0
    rollout_rs: CorrectionLevel | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    bypass_mode: bool = False

    def __post_init__(self) -> None:
        if self.enable not in (True, False, "auto"):
            raise ConfigError(f"algo.rollout_correction.enable={self.enable!r} must be auto, true or false")
        for name in ("rollout_is", "rollout_rs"):
            if getattr(self, name) is not None:
                setattr(self, name, parse_kind(CorrectionLevel, getattr(self, name), f"rollout_correction.{name}"))
        if not self.rollout_is_threshold > 0:
            raise ConfigError(f"algo.rollout_correction.rollout_is_threshold={self.rollout_is_threshold} must be > 0")
        upper, lower = self.rs_bounds
        if not 0 <= lower <= upper:
            raise ConfigError(f"algo.rollout_correction rejection band [{lower}, {upper}] (rollout_rs_threshold_lower,"
                              " rollout_rs_threshold) needs 0 <= lower <= upper")
        if self.bypass_mode and (self.rollout_is or self.rollout_rs):
            raise ConfigError("algo.rollout_correction.bypass_mode=true anchors PPO at the rollout log-probs (the "
                              "clipped ratio is the correction); set rollout_is and rollout_rs to null, or bypass "
                              "off for decoupled weights")

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """(upper, lower) ratio band of the rejection mask."""
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return upper, lower

    def resolved(self, *, weights_shared: bool) -> RolloutCorrectionConfig:
        """`auto` decided for this run: off when the engine samples with the actor's own weights."""
        return self if self.enable != "auto" else replace(self, enable=not weights_shared)

    @property
    def active(self) -> bool:
        assert self.enable != "auto", "resolve `auto` with resolved() before training"
        return bool(self.enable)

    @property
    def needs_old_logprobs(self) -> bool:
        """Decoupled correction compares pi_old with pi_rollout, so it needs the old-logprob forward."""
        return self.active and not self.bypass_mode


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

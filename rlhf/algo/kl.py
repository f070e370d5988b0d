"""KL(policy || reference) estimators per token, KL as a reward penalty (fixed/adaptive coefficient) or loss.

Estimators on log r = logp - ref_logp (Schulman's k1/k2/k3): k1 = log r, abs = |log r|, k2 = (log r)^2 / 2,
k3 = exp(-log r) + log r - 1 (non-negative, low variance; clamped like verl's `low_var_kl`).
`straight_through=True` keeps the estimator's value but takes the gradient of k2 (unbiased KL gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algo.aggregation import GlobalCounts, aggregate_loss
from rlhf.algo.config import KLConfig, KLControllerKind, KLEstimator
from rlhf.algo.registry import Registry

K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


KLEstimatorFn = Callable[[Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator, KLEstimatorFn] = Registry(KLEstimator, "KL estimator")


@KL_ESTIMATORS.register(KLEstimator.K1)
def _k1(log_ratio_bt: Tensor) -> Tensor:
    return log_ratio_bt


@KL_ESTIMATORS.register(KLEstimator.ABS)
def _abs(log_ratio_bt: Tensor) -> Tensor:
    return log_ratio_bt.abs()


@KL_ESTIMATORS.register(KLEstimator.K2)
def _k2(log_ratio_bt: Tensor) -> Tensor:
    return 0.5 * log_ratio_bt.square()


@KL_ESTIMATORS.register(KLEstimator.K3)
def _k3(log_ratio_bt: Tensor) -> Tensor:
    neg_log_ratio_bt = (-log_ratio_bt).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (neg_log_ratio_bt.exp() - neg_log_ratio_bt - 1.0).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def kl_penalty(logprobs_bt: Tensor, ref_logprobs_bt: Tensor, estimator: KLEstimator, *,
               straight_through: bool = False) -> Tensor:
    """Per-token KL estimate [B, T]; with straight_through the value is kept and the gradient is k2's."""
    log_ratio_bt = logprobs_bt - ref_logprobs_bt
    kl_bt = KL_ESTIMATORS.get(estimator)(log_ratio_bt)
    if not straight_through:
        return kl_bt
    k2_bt = _k2(log_ratio_bt)
    return kl_bt.detach() + (k2_bt - k2_bt.detach())


def kl_loss(logprobs_bt: Tensor, ref_logprobs_bt: Tensor, response_mask_bt: Tensor, config: KLConfig,
            counts: GlobalCounts) -> tuple[Tensor, Tensor]:
    """(coef * aggregated KL, detached aggregated KL): this shard's share, summed over shards by the trainer."""
    kl_bt = kl_penalty(logprobs_bt, ref_logprobs_bt, config.estimator, straight_through=config.straight_through)
    kl = aggregate_loss(kl_bt, response_mask_bt, mode=config.agg, counts=counts,
                        norm_length=config.agg_norm_length)
    return config.coef * kl, kl.detach()


@dataclass(kw_only=True)
class KLInReward:
    token_rewards_bt: Tensor  # scores - coef * KL on response tokens, 0 elsewhere
    seq_kl_b: Tensor  # per-sequence mean KL (0 for empty responses), for the controller and metrics


def apply_kl_in_reward(token_scores_bt: Tensor, logprobs_bt: Tensor, ref_logprobs_bt: Tensor,
                       response_mask_bt: Tensor, estimator: KLEstimator, coef: float) -> KLInReward:
    """Per-token rewards = scores - coef * KL(old policy || ref) on response tokens (no gradient)."""
    mask = response_mask_bt.bool()
    with torch.no_grad():
        kl_bt = torch.where(mask, kl_penalty(logprobs_bt, ref_logprobs_bt, estimator), 0.0)
        rewards_bt = torch.where(mask, token_scores_bt - coef * kl_bt, 0.0)
        seq_kl_b = kl_bt.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return KLInReward(token_rewards_bt=rewards_bt, seq_kl_b=seq_kl_b)


@dataclass(kw_only=True)
class KLController:
    """The in-reward KL coefficient; adaptive mode scales it by 1 + clip(kl/target - 1, +-0.2) * n / horizon."""

    value: float
    kind: KLControllerKind = KLControllerKind.FIXED
    target: float | None = None
    horizon: int | None = None

    @classmethod
    def from_config(cls, config: KLConfig) -> KLController:
        return cls(value=config.coef, kind=config.controller, target=config.target, horizon=config.horizon)

    def update(self, current_kl: float, num_samples: int) -> None:
        """Call once per step with the global mean sequence KL and the global number of samples."""
        if self.kind is KLControllerKind.FIXED:
            return
        assert self.target is not None and self.horizon is not None, "validated by KLConfig"
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_samples / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])

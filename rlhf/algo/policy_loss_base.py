"""What every policy loss shares: its inputs, its verl-named metrics, the registry and masked helpers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algo.aggregation import GlobalCounts, aggregate_loss
from rlhf.algo.config import PolicyLossConfig, PolicyLossKind
from rlhf.algo.registry import Registry

LOG_RATIO_CLAMP = 20.0  # keeps exp(log ratio) finite


@dataclass(frozen=True, kw_only=True)
class PolicyLossInputs:
    """One micro-batch, response-aligned [B, T]; weights and the covariance selection are detached."""

    logprobs_bt: Tensor  # current policy, with grad
    old_logprobs_bt: Tensor
    advantages_bt: Tensor
    response_mask_bt: Tensor
    is_weights_bt: Tensor | None = None  # rollout-correction weights (>= 0), applied as verl applies them
    cov_selected_bt: Tensor | None = None  # Clip-Cov / KL-Cov: tokens picked on the global batch (bool)

    @property
    def mask(self) -> Tensor:
        return self.response_mask_bt.bool()


@dataclass(kw_only=True)
class PolicyLossMetrics:
    """Detached partial sums (reduce: sum over micro-batches and DP ranks)."""

    pg_loss: Tensor
    pg_clipfrac: Tensor  # fraction of tokens the loss's clip / mask / selection acted on
    pg_clipfrac_lower: Tensor  # fraction of tokens where the dual clip (DPPO: the ratio truncation) was active
    ppo_kl: Tensor  # token-mean of (old - new) log-prob (clamped to +-20), an approximate KL(old || new)

    def as_dict(self, prefix: str = "actor/") -> dict[str, Tensor]:
        return {f"{prefix}{name}": value for name, value in vars(self).items()}


PolicyLossFn = Callable[[PolicyLossInputs, PolicyLossConfig, GlobalCounts], tuple[Tensor, PolicyLossMetrics]]
POLICY_LOSSES: Registry[PolicyLossKind, PolicyLossFn] = Registry(PolicyLossKind, "policy loss")


def masked(x_bt: Tensor, mask: Tensor) -> Tensor:
    """x on the mask, 0 elsewhere (NaN padding never leaks into values or gradients)."""
    return torch.where(mask, x_bt, torch.zeros_like(x_bt))


def token_fraction(flag_bt: Tensor, mask: Tensor, counts: GlobalCounts) -> Tensor:
    return (flag_bt & mask).sum().double() / max(counts.num_tokens, 1)


def zero_metric(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=torch.float64, device=like.device)


def log_ratio(inputs: PolicyLossInputs, clamp: bool = True) -> Tensor:
    """log pi - log pi_old on the mask (0 elsewhere), clamped to +-20 unless `clamp` is false."""
    log_ratio_bt = masked(inputs.logprobs_bt - inputs.old_logprobs_bt, inputs.mask)
    return log_ratio_bt.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp else log_ratio_bt


def finish(losses_bt: Tensor, inputs: PolicyLossInputs, config: PolicyLossConfig, counts: GlobalCounts, *,
           clipped_bt: Tensor | None = None, lower_bt: Tensor | None = None,
           weighted: bool = True) -> tuple[Tensor, PolicyLossMetrics]:
    """Weight per-token losses by the IS weights (unless already applied), aggregate, and build the metrics."""
    mask = inputs.mask
    if weighted and inputs.is_weights_bt is not None:
        losses_bt = losses_bt * masked(inputs.is_weights_bt, mask)
    loss = aggregate_loss(losses_bt, mask, mode=config.agg, counts=counts, norm_length=config.agg_norm_length)
    kl_bt = -log_ratio(inputs).detach()
    metrics = PolicyLossMetrics(
        pg_loss=loss.detach(),
        pg_clipfrac=zero_metric(loss) if clipped_bt is None else token_fraction(clipped_bt, mask, counts),
        pg_clipfrac_lower=zero_metric(loss) if lower_bt is None else token_fraction(lower_bt, mask, counts),
        ppo_kl=kl_bt.sum().double() / max(counts.num_tokens, 1))
    return loss, metrics

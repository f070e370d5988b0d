"""Clipped policy-gradient losses (PPO with clip-higher and dual-clip; GSPO) over [B, T] log-probs.

Losses and metrics are this shard's share of the global-batch value (see aggregation.py): sum them over
micro-batches and DP ranks. Token metrics (clipfrac, approx KL) are token means over the global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algo.aggregation import GlobalCounts, aggregate_loss
from rlhf.algo.config import PolicyLossConfig, PolicyLossKind
from rlhf.algo.registry import Registry

LOG_RATIO_CLAMP = 20.0  # keeps exp(log ratio) finite for PPO
GSPO_LOG_RATIO_MAX = 10.0


@dataclass(kw_only=True)
class PolicyLossMetrics:
    """Detached partial sums (reduce: sum over micro-batches and DP ranks)."""

    pg_loss: Tensor
    pg_clipfrac: Tensor  # fraction of tokens where the ratio clip was active
    pg_clipfrac_lower: Tensor  # fraction of tokens where the dual clip was active
    ppo_kl: Tensor  # token-mean of (old - new) log-prob, an approximate KL(old || new)

    def as_dict(self, prefix: str = "actor/") -> dict[str, Tensor]:
        return {f"{prefix}{name}": value for name, value in vars(self).items()}


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, PolicyLossConfig, GlobalCounts],
                        tuple[Tensor, PolicyLossMetrics]]
POLICY_LOSSES: Registry[PolicyLossKind, PolicyLossFn] = Registry(PolicyLossKind, "policy loss")


def policy_loss(logprobs_bt: Tensor, old_logprobs_bt: Tensor, advantages_bt: Tensor, response_mask_bt: Tensor,
                config: PolicyLossConfig, counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """The configured policy loss: (loss share, metrics)."""
    return POLICY_LOSSES.get(config.kind)(logprobs_bt, old_logprobs_bt, advantages_bt, response_mask_bt,
                                          config, counts)


def _token_fraction(flag_bt: Tensor, mask: Tensor, counts: GlobalCounts) -> Tensor:
    return (flag_bt & mask).sum().double() / max(counts.num_tokens, 1)


def _masked(x_bt: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x_bt, torch.zeros_like(x_bt))


@POLICY_LOSSES.register(PolicyLossKind.PPO)
def ppo_clip_loss(logprobs_bt: Tensor, old_logprobs_bt: Tensor, advantages_bt: Tensor, response_mask_bt: Tensor,
                  config: PolicyLossConfig, counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """max(-A r, -A clip(r)) per token; for A < 0 additionally capped at -A * clip_ratio_c (dual clip)."""
    mask = response_mask_bt.bool()
    log_ratio_bt = _masked(logprobs_bt - old_logprobs_bt, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio_bt = torch.exp(log_ratio_bt)
    advantages = _masked(advantages_bt, mask)
    unclipped_bt = -advantages * ratio_bt
    clipped_bt = -advantages * ratio_bt.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    losses_bt = torch.maximum(unclipped_bt, clipped_bt)
    clip_active_bt = clipped_bt > unclipped_bt
    dual_active_bt = torch.zeros_like(mask)
    if config.clip_ratio_c is not None:
        dual_bound_bt = -advantages * config.clip_ratio_c
        dual_active_bt = (advantages < 0) & (losses_bt > dual_bound_bt)
        losses_bt = torch.where(dual_active_bt, dual_bound_bt, losses_bt)
    loss = aggregate_loss(losses_bt, mask, mode=config.agg, counts=counts, norm_length=config.agg_norm_length)
    metrics = PolicyLossMetrics(
        pg_loss=loss.detach(), pg_clipfrac=_token_fraction(clip_active_bt, mask, counts),
        pg_clipfrac_lower=_token_fraction(dual_active_bt, mask, counts),
        ppo_kl=(-log_ratio_bt.detach()).sum().double() / max(counts.num_tokens, 1))
    return loss, metrics


@POLICY_LOSSES.register(PolicyLossKind.GSPO)
def gspo_loss(logprobs_bt: Tensor, old_logprobs_bt: Tensor, advantages_bt: Tensor, response_mask_bt: Tensor,
              config: PolicyLossConfig, counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """GSPO: the clipped ratio is the sequence's geometric-mean ratio; the gradient flows per token.

    Per token the ratio is sg[s_i] * pi / sg[pi], so its value is s_i and its gradient that of s_i * log pi.
    The paper's objective is `agg=seq-mean-token-mean`.
    """
    mask = response_mask_bt.bool()
    log_ratio_bt = _masked(logprobs_bt - old_logprobs_bt, mask)
    seq_log_ratio_b = log_ratio_bt.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio_bt = logprobs_bt - logprobs_bt.detach() + seq_log_ratio_b.detach().unsqueeze(-1)
    ratio_bt = torch.exp(_masked(token_log_ratio_bt, mask).clamp(max=GSPO_LOG_RATIO_MAX))
    advantages = _masked(advantages_bt, mask)
    unclipped_bt = -advantages * ratio_bt
    clipped_bt = -advantages * ratio_bt.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    losses_bt = torch.maximum(unclipped_bt, clipped_bt)
    loss = aggregate_loss(losses_bt, mask, mode=config.agg, counts=counts, norm_length=config.agg_norm_length)
    metrics = PolicyLossMetrics(
        pg_loss=loss.detach(), pg_clipfrac=_token_fraction(clipped_bt > unclipped_bt, mask, counts),
        pg_clipfrac_lower=torch.zeros((), dtype=torch.float64, device=logprobs_bt.device),
        ppo_kl=(-log_ratio_bt.detach()).sum().double() / max(counts.num_tokens, 1))
    return loss, metrics

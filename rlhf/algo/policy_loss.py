"""Policy losses over [B, T] log-probs, picked by `PolicyLossConfig.kind`: PPO (clip-higher, dual clip) and GSPO
here, the ratio variants in policy_loss_ratio.py, Clip-Cov / KL-Cov in policy_loss_cov.py.

Losses and metrics are this shard's share of the global-batch value (see aggregation.py): sum them over
micro-batches and DP ranks. Token metrics (clipfrac, approx KL) are token means over the global batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algo import policy_loss_cov, policy_loss_ratio  # noqa: F401  (importing them registers their losses)
from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import PolicyLossConfig, PolicyLossKind
from rlhf.algo.policy_loss_base import (POLICY_LOSSES, PolicyLossInputs, PolicyLossMetrics, finish, log_ratio,
                                        masked)

GSPO_LOG_RATIO_MAX = 10.0


def policy_loss(logprobs_bt: Tensor, old_logprobs_bt: Tensor, advantages_bt: Tensor, response_mask_bt: Tensor,
                config: PolicyLossConfig, counts: GlobalCounts, *, is_weights_bt: Tensor | None = None,
                cov_selected_bt: Tensor | None = None) -> tuple[Tensor, PolicyLossMetrics]:
    """The configured policy loss: (loss share, metrics)."""
    inputs = PolicyLossInputs(logprobs_bt=logprobs_bt, old_logprobs_bt=old_logprobs_bt, advantages_bt=advantages_bt,
                              response_mask_bt=response_mask_bt, is_weights_bt=is_weights_bt,
                              cov_selected_bt=cov_selected_bt)
    return POLICY_LOSSES.get(config.kind)(inputs, config, counts)


def weighted_advantages(inputs: PolicyLossInputs) -> Tensor:
    """A * w on the mask: w >= 0 commutes with the clip's max and the dual-clip bound, so loss(w A) = w loss(A)."""
    advantages_bt = inputs.advantages_bt
    if inputs.is_weights_bt is not None:
        advantages_bt = advantages_bt * inputs.is_weights_bt
    return masked(advantages_bt, inputs.mask)


@POLICY_LOSSES.register(PolicyLossKind.PPO)
def ppo_clip_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
                  counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """max(-A r, -A clip(r)) per token; for A < 0 additionally capped at -A * clip_ratio_c (dual clip)."""
    ratio_bt = torch.exp(log_ratio(inputs))
    advantages = weighted_advantages(inputs)
    unclipped_bt = -advantages * ratio_bt
    clipped_bt = -advantages * ratio_bt.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    losses_bt = torch.maximum(unclipped_bt, clipped_bt)
    dual_active_bt = torch.zeros_like(inputs.mask)
    if config.clip_ratio_c is not None:
        dual_bound_bt = -advantages * config.clip_ratio_c
        dual_active_bt = (advantages < 0) & (losses_bt > dual_bound_bt)
        losses_bt = torch.where(dual_active_bt, dual_bound_bt, losses_bt)
    return finish(losses_bt, inputs, config, counts, clipped_bt=clipped_bt > unclipped_bt, lower_bt=dual_active_bt,
                  weighted=False)


@POLICY_LOSSES.register(PolicyLossKind.GSPO)
def gspo_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
              counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """GSPO: the clipped ratio is the sequence's geometric-mean ratio; the gradient flows per token.

    Per token the ratio is sg[s_i] * pi / sg[pi], so its value is s_i and its gradient that of s_i * log pi.
    The paper's objective is `agg=seq-mean-token-mean` (verl forces it; rlhf honours `agg`).
    """
    mask = inputs.mask
    logprobs_bt = inputs.logprobs_bt
    seq_log_ratio_b = log_ratio(inputs, clamp=False).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio_bt = logprobs_bt - logprobs_bt.detach() + seq_log_ratio_b.detach().unsqueeze(-1)
    ratio_bt = torch.exp(masked(token_log_ratio_bt, mask).clamp(max=GSPO_LOG_RATIO_MAX))
    advantages = weighted_advantages(inputs)
    unclipped_bt = -advantages * ratio_bt
    clipped_bt = -advantages * ratio_bt.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    losses_bt = torch.maximum(unclipped_bt, clipped_bt)
    return finish(losses_bt, inputs, config, counts, clipped_bt=clipped_bt > unclipped_bt, weighted=False)

"""Clip-Cov and KL-Cov (arXiv 2505.22617): tokens whose advantage and log-prob covary most lose their gradient
(Clip-Cov) or get a |log ratio| penalty (KL-Cov), which keeps the policy's entropy from collapsing.

verl picks the tokens inside each micro-batch from the current log-probs (Clip-Cov at random with the global RNG).
rlhf picks them once per step on the global batch, from the old log-probs (equal to the current ones at the
first update), with an explicit generator: the choice is DP / micro-batch invariant and reproducible.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import PolicyLossConfig, PolicyLossKind
from rlhf.algo.policy_loss_base import POLICY_LOSSES, PolicyLossInputs, PolicyLossMetrics, finish, log_ratio, masked
from rlhf.errors import ConfigError

COVARIANCE_KINDS = (PolicyLossKind.CLIP_COV, PolicyLossKind.KL_COV)


def covariance_selection(config: PolicyLossConfig, advantages_bt: Tensor, logprobs_bt: Tensor,
                         response_mask_bt: Tensor, generator: torch.Generator) -> Tensor:
    """bool [B, T]: the tokens Clip-Cov / KL-Cov act on, chosen over this whole (global) batch.

    cov_t = (A_t - mean A) (log pi_t - mean log pi) over response tokens. Clip-Cov: max(1, int(clip_cov_ratio N))
    tokens drawn uniformly from those with clip_cov_lb < cov < clip_cov_ub; KL-Cov: the max(1, int(kl_cov_ratio N))
    largest (ties by position).
    """
    assert config.kind in COVARIANCE_KINDS, config.kind
    mask = response_mask_bt.bool()
    selected_bt = torch.zeros_like(mask)
    num_tokens = int(mask.sum())
    if num_tokens == 0:
        return selected_bt
    advantages = advantages_bt.double()[mask]
    logprobs = logprobs_bt.double()[mask]
    cov_n = (advantages - advantages.mean()) * (logprobs - logprobs.mean())
    flat_positions_n = mask.flatten().nonzero().flatten()
    if config.kind is PolicyLossKind.CLIP_COV:
        num = max(int(config.clip_cov_ratio * num_tokens), 1)
        candidates_n = ((cov_n > config.clip_cov_lb) & (cov_n < config.clip_cov_ub)).nonzero().flatten()
        picked_n = candidates_n[torch.randperm(candidates_n.numel(), generator=generator)[:num]]
    else:
        num = max(int(config.kl_cov_ratio * num_tokens), 1)
        picked_n = torch.sort(cov_n, descending=True, stable=True).indices[:num]
    selected_bt.view(-1)[flat_positions_n[picked_n.to(flat_positions_n.device)]] = True
    return selected_bt


def _selected(inputs: PolicyLossInputs, kind: PolicyLossKind) -> Tensor:
    if inputs.cov_selected_bt is None:
        raise ConfigError(f"policy loss {kind.value!r} needs the step's token selection (covariance_selection on the "
                          "global batch, passed as cov_selected_bt); this training path does not provide it")
    return inputs.cov_selected_bt.bool() & inputs.mask


@POLICY_LOSSES.register(PolicyLossKind.CLIP_COV)
def clip_cov_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
                  counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """PPO's clipped loss (no dual clip, as verl) with the selected tokens removed (value and gradient);
    clipfrac is the selected fraction."""
    mask = inputs.mask
    selected_bt = _selected(inputs, PolicyLossKind.CLIP_COV)
    ratio_bt = torch.exp(log_ratio(inputs))
    advantages_bt = masked(inputs.advantages_bt, mask)
    losses_bt = torch.maximum(-advantages_bt * ratio_bt,
                              -advantages_bt * ratio_bt.clamp(1.0 - config.clip_low, 1.0 + config.clip_high))
    return finish(masked(losses_bt, ~selected_bt), inputs, config, counts, clipped_bt=selected_bt)


@POLICY_LOSSES.register(PolicyLossKind.KL_COV)
def kl_cov_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
                counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """-A r, unclipped, plus ppo_kl_coef * |log r| on the selected tokens; clipfrac is the selected fraction.
    verl reports mean |log r| as actor/ppo_kl here; rlhf keeps ppo_kl the approximate KL of every loss."""
    mask = inputs.mask
    selected_bt = _selected(inputs, PolicyLossKind.KL_COV)
    log_ratio_bt = log_ratio(inputs)
    losses_bt = -masked(inputs.advantages_bt, mask) * torch.exp(log_ratio_bt)
    losses_bt = losses_bt + config.ppo_kl_coef * masked(log_ratio_bt.abs(), selected_bt)
    return finish(losses_bt, inputs, config, counts, clipped_bt=selected_bt)

"""Ratio-shaped policy losses verl 0.9 registers: CISPO, GMPO (geo_mean), SAPO, GPG and DPPO (TV / binary KL).

Each is one function over `PolicyLossInputs`; rollout-correction weights multiply the per-token loss (GMPO: their
per-row geometric mean multiplies the row's loss), then `agg` reduces with global counts, as for PPO.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import PolicyLossConfig, PolicyLossKind
from rlhf.algo.policy_loss_base import POLICY_LOSSES, PolicyLossInputs, PolicyLossMetrics, finish, log_ratio, masked

BINARY_KL_EPS = 1e-8  # verl's guard on log(1 - p)
WEIGHT_LOG_EPS = 1e-10  # verl's guard on log(w) for GMPO's geometric-mean weight


@POLICY_LOSSES.register(PolicyLossKind.CISPO)
def cispo_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
               counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """-sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * log pi: every token keeps a gradient, the clip bounds its size.

    The value is the paper's (it moves with log pi, not with the ratio); clipfrac counts tokens whose ratio was clipped.
    """
    mask = inputs.mask
    ratio_bt = torch.exp(log_ratio(inputs))
    clipped_ratio_bt = ratio_bt.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    losses_bt = -clipped_ratio_bt.detach() * masked(inputs.advantages_bt, mask) * masked(inputs.logprobs_bt, mask)
    return finish(losses_bt, inputs, config, counts, clipped_bt=ratio_bt != clipped_ratio_bt)


@POLICY_LOSSES.register(PolicyLossKind.GEO_MEAN)
def geo_mean_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
                  counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """GMPO: -A_i * exp(mean_t clip_sgn(A)(log r_t)) per row, A_i the row's mean advantage, log r clipped to
    [-clip_low, clip_high] on the side that limits the update (sign of A).

    verl ignores loss_agg_mode and takes a plain mean over the micro-batch's rows (empty rows count); rlhf puts the
    row's loss on each of its tokens and reduces with `agg` and global counts, so `seq-mean-token-mean` is the
    paper's objective and the loss is DP / micro-batch invariant.
    """
    mask = inputs.mask
    log_ratio_bt = log_ratio(inputs, clamp=False)
    sign_bt = torch.sign(masked(inputs.advantages_bt, mask))
    clamped_bt = log_ratio_bt.clamp(-config.clip_low, config.clip_high)
    limited_bt = sign_bt * torch.minimum(sign_bt * log_ratio_bt, sign_bt * clamped_bt)
    lengths_b = mask.sum(dim=-1).clamp(min=1)
    ratio_b = torch.exp(masked(limited_bt, mask).sum(dim=-1) / lengths_b)
    advantage_b = masked(inputs.advantages_bt, mask).sum(dim=-1) / lengths_b
    row_loss_b = -advantage_b * ratio_b
    if inputs.is_weights_bt is not None:
        log_weights_bt = torch.log(masked(inputs.is_weights_bt, mask) + WEIGHT_LOG_EPS)
        row_loss_b = row_loss_b * torch.exp(masked(log_weights_bt, mask).sum(dim=-1) / lengths_b)
    losses_bt = row_loss_b.unsqueeze(-1).expand_as(log_ratio_bt)
    clipped_bt = log_ratio_bt != clamped_bt
    return finish(losses_bt, inputs, config, counts, clipped_bt=clipped_bt & (inputs.advantages_bt > 0),
                  lower_bt=clipped_bt & (inputs.advantages_bt < 0), weighted=False)


@POLICY_LOSSES.register(PolicyLossKind.SAPO)
def sapo_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
              counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """SAPO: -A * (4 / tau) * sigmoid(tau (r - 1)), tau = tau_pos for A > 0 else tau_neg; at r = 1 the gradient
    is the policy gradient, away from it the gate fades it smoothly instead of a hard clip.

    verl forces seq-mean-token-mean for SAPO whatever loss_agg_mode says; rlhf honours `agg` (set
    seq-mean-token-mean for the paper's objective).
    """
    mask = inputs.mask
    advantages_bt = masked(inputs.advantages_bt, mask)
    ratio_bt = torch.exp(log_ratio(inputs))
    taus = torch.tensor([config.tau_neg, config.tau_pos], dtype=ratio_bt.dtype, device=ratio_bt.device)
    tau_bt = taus[(advantages_bt > 0).long()]
    gate_bt = torch.sigmoid(tau_bt * (ratio_bt - 1.0)) * (4.0 / tau_bt)
    return finish(-gate_bt * advantages_bt, inputs, config, counts)


@POLICY_LOSSES.register(PolicyLossKind.GPG)
def gpg_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
             counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """GPG: -A * log pi, no ratio and no clip (pair it with the gpg advantage estimator)."""
    mask = inputs.mask
    return finish(-masked(inputs.advantages_bt, mask) * masked(inputs.logprobs_bt, mask), inputs, config, counts)


def _dppo_loss(inputs: PolicyLossInputs, config: PolicyLossConfig, counts: GlobalCounts,
               valid_bt: Tensor) -> tuple[Tensor, PolicyLossMetrics]:
    """-A * sg[min(r, clip_ratio_c)] * log pi on the tokens `valid_bt` keeps (DPPO's trust region is a mask)."""
    mask = inputs.mask
    ratio_bt = torch.exp(log_ratio(inputs))
    truncated_bt = ratio_bt if config.clip_ratio_c is None else ratio_bt.clamp(max=config.clip_ratio_c)
    valid_bt = valid_bt.detach() & mask
    losses_bt = -masked(inputs.advantages_bt, mask) * truncated_bt.detach() * masked(inputs.logprobs_bt, mask)
    losses_bt = masked(losses_bt, valid_bt)
    return finish(losses_bt, inputs, config, counts, clipped_bt=~valid_bt,
                  lower_bt=(ratio_bt > truncated_bt) & valid_bt)


def _probs(inputs: PolicyLossInputs) -> tuple[Tensor, Tensor]:
    mask = inputs.mask
    return torch.exp(masked(inputs.logprobs_bt, mask)), torch.exp(masked(inputs.old_logprobs_bt, mask))


@POLICY_LOSSES.register(PolicyLossKind.DPPO_TV)
def dppo_tv_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
                 counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """DPPO-Binary-TV: a token leaves the loss once p - p_old > clip_high (A > 0) or < -clip_low (A <= 0).

    verl's comment recommends a large clip_ratio_c (its fallback is 20) but its actor default 3.0 applies; rlhf
    does the same: set clip_ratio_c=20 for the paper's setting.
    """
    probs_bt, old_probs_bt = _probs(inputs)
    moved_bt = probs_bt - old_probs_bt
    valid_bt = torch.where(inputs.advantages_bt > 0, moved_bt <= config.clip_high, moved_bt >= -config.clip_low)
    return _dppo_loss(inputs, config, counts, valid_bt)


@POLICY_LOSSES.register(PolicyLossKind.DPPO_KL)
def dppo_kl_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
                 counts: GlobalCounts) -> tuple[Tensor, PolicyLossMetrics]:
    """DPPO-Binary-KL: a token leaves the loss once KL(Bern(p_old) || Bern(p)) exceeds clip_high while p rises
    (A > 0), or clip_low while p falls (A <= 0). clip_ratio_c as for dppo_tv."""
    probs_bt, old_probs_bt = _probs(inputs)
    mask = inputs.mask
    old_log_bt, log_bt = masked(inputs.old_logprobs_bt, mask), masked(inputs.logprobs_bt, mask)
    binary_kl_bt = old_probs_bt * (old_log_bt - log_bt) + (1.0 - old_probs_bt) * torch.log(
        (1.0 - old_probs_bt + BINARY_KL_EPS) / (1.0 - probs_bt + BINARY_KL_EPS))
    valid_bt = torch.where(inputs.advantages_bt > 0, (binary_kl_bt <= config.clip_high) | (probs_bt <= old_probs_bt),
                           (binary_kl_bt <= config.clip_low) | (probs_bt >= old_probs_bt))
    return _dppo_loss(inputs, config, counts, valid_bt)

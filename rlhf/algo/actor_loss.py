"""The actor's total loss: policy loss - entropy_coef * entropy + KL loss term, with verl-named metrics.

In rollout correction's bypass mode (old log-probs = the rollout's) the weights and rejection are computed here,
per micro-batch, from the current policy: rejected tokens leave every term but stay in the global counts (as
verl), and loss_type=reinforce replaces the policy loss by -A * w * log pi (the gpg loss with the weights).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

from rlhf.algo.aggregation import GlobalCounts, aggregate_loss
from rlhf.algo.config import PolicyLossKind
from rlhf.algo.correction_config import BypassLossType, RolloutCorrectionConfig
from rlhf.algo.kl import KLConfig, kl_loss
from rlhf.algo.policy_loss import PolicyLossConfig, PolicyLossMetrics, policy_loss
from rlhf.algo.rollout_correction import in_loss_correction
from rlhf.errors import ConfigError


@dataclass(kw_only=True)
class ActorLossInputs:
    """One micro-batch, response-aligned [B, T]; ref log-probs only with a KL loss, entropy only if used."""

    logprobs_bt: Tensor  # current policy, with grad
    old_logprobs_bt: Tensor  # policy that generated/scored the rollouts
    advantages_bt: Tensor
    response_mask_bt: Tensor
    ref_logprobs_bt: Tensor | None = None
    entropy_bt: Tensor | None = None  # with grad when entropy_coef > 0
    is_weights_bt: Tensor | None = None  # detached rollout-correction weights (>= 0) on the policy loss
    cov_selected_bt: Tensor | None = None  # Clip-Cov / KL-Cov tokens (covariance_selection on the global batch)


@dataclass(kw_only=True)
class ActorLossMetrics:
    """Detached partial sums (reduce: sum over micro-batches and DP ranks); absent terms are None. Constants
    such as the KL coefficient are not partial sums: the caller reports those once per step."""

    policy: PolicyLossMetrics
    entropy: Tensor | None = None  # aggregated like the policy loss
    kl_loss: Tensor | None = None
    rejected_fraction: Tensor | None = None  # bypass-mode rejection: share of the global batch's tokens

    def as_dict(self, prefix: str = "actor/") -> dict[str, Tensor | float]:
        extra = {"entropy": self.entropy, "kl_loss": self.kl_loss}
        out = self.policy.as_dict(prefix) | {f"{prefix}{k}": v for k, v in extra.items() if v is not None}
        if self.rejected_fraction is not None:
            out["rollout_corr/rs_masked_fraction"] = self.rejected_fraction
        return out


def _bypass_corrected(inputs: ActorLossInputs, policy_config: PolicyLossConfig, correction: RolloutCorrectionConfig,
                      counts: GlobalCounts) -> tuple[ActorLossInputs, PolicyLossConfig, Tensor]:
    """Inputs with the in-loss weights and rejection applied, the loss config to use, the rejected share."""
    weights_bt, keep_bt = in_loss_correction(inputs.logprobs_bt, inputs.old_logprobs_bt, inputs.response_mask_bt,
                                             correction)
    if correction.loss_type is BypassLossType.REINFORCE:
        policy_config = dataclasses.replace(policy_config, kind=PolicyLossKind.GPG)
    rejected = (inputs.response_mask_bt.bool() & ~keep_bt).sum().double() / max(counts.num_tokens, 1)
    return dataclasses.replace(inputs, response_mask_bt=keep_bt, is_weights_bt=weights_bt), policy_config, rejected


def actor_loss(inputs: ActorLossInputs, policy_config: PolicyLossConfig, kl_config: KLConfig, counts: GlobalCounts,
               correction: RolloutCorrectionConfig | None = None) -> tuple[Tensor, ActorLossMetrics]:
    """This micro-batch's share of the global actor loss (sum the shares; see aggregation.py). `correction`: the
    run's resolved rollout correction (only bypass mode with weights, rejection or REINFORCE acts here)."""
    rejected = None
    if correction is not None and correction.corrects_in_loss:
        inputs, policy_config, rejected = _bypass_corrected(inputs, policy_config, correction, counts)
    loss, policy_metrics = policy_loss(inputs.logprobs_bt, inputs.old_logprobs_bt, inputs.advantages_bt,
                                       inputs.response_mask_bt, policy_config, counts,
                                       is_weights_bt=inputs.is_weights_bt, cov_selected_bt=inputs.cov_selected_bt)
    metrics = ActorLossMetrics(policy=policy_metrics, rejected_fraction=rejected)
    if inputs.entropy_bt is not None:
        entropy = aggregate_loss(inputs.entropy_bt, inputs.response_mask_bt, mode=policy_config.agg,
                                 counts=counts, norm_length=policy_config.agg_norm_length)
        metrics.entropy = entropy.detach()
        if policy_config.entropy_coef > 0.0:
            loss = loss - policy_config.entropy_coef * entropy
    elif policy_config.entropy_coef > 0.0:
        raise ConfigError(f"entropy_coef={policy_config.entropy_coef} needs the per-token entropy (entropy_bt)")
    if kl_config.use_as_loss:
        if inputs.ref_logprobs_bt is None:
            raise ConfigError(f"KL loss (coef={kl_config.coef}, in_reward=false) needs reference log-probs")
        kl_term, kl_value = kl_loss(inputs.logprobs_bt, inputs.ref_logprobs_bt, inputs.response_mask_bt,
                                    kl_config, counts)
        loss = loss + kl_term
        metrics.kl_loss = kl_value
    return loss, metrics


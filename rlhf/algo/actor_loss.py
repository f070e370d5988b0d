"""The actor's total loss: policy loss - entropy_coef * entropy + KL loss term, with verl-named metrics."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from rlhf.algo.aggregation import GlobalCounts, aggregate_loss
from rlhf.algo.kl import KLConfig, kl_loss
from rlhf.algo.policy_loss import PolicyLossConfig, PolicyLossMetrics, policy_loss
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


@dataclass(kw_only=True)
class ActorLossMetrics:
    """Detached partial sums (reduce: sum over micro-batches and DP ranks); absent terms are None. Constants
    such as the KL coefficient are not partial sums: the caller reports those once per step."""

    policy: PolicyLossMetrics
    entropy: Tensor | None = None  # aggregated like the policy loss
    kl_loss: Tensor | None = None

    def as_dict(self, prefix: str = "actor/") -> dict[str, Tensor | float]:
        extra = {"entropy": self.entropy, "kl_loss": self.kl_loss}
        return self.policy.as_dict(prefix) | {f"{prefix}{k}": v for k, v in extra.items() if v is not None}


def actor_loss(inputs: ActorLossInputs, policy_config: PolicyLossConfig, kl_config: KLConfig,
               counts: GlobalCounts) -> tuple[Tensor, ActorLossMetrics]:
    """This micro-batch's share of the global actor loss (sum the shares; see aggregation.py)."""
    advantages_bt = inputs.advantages_bt
    if inputs.is_weights_bt is not None:
        # w >= 0 commutes with the clip's max and the dual-clip bound: w * loss(A) == loss(w * A), value and grad
        advantages_bt = advantages_bt * inputs.is_weights_bt
    loss, policy_metrics = policy_loss(inputs.logprobs_bt, inputs.old_logprobs_bt, advantages_bt,
                                       inputs.response_mask_bt, policy_config, counts)
    metrics = ActorLossMetrics(policy=policy_metrics)
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


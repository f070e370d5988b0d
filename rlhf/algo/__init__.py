"""RL core: advantage estimators, policy/value losses, KL, loss aggregation, running stats (pure tensor code).

Shapes: response-aligned [B, T] tensors with `response_mask_bt` (1 on response tokens), sequence scores [B].
Losses take `GlobalCounts` of the whole step batch so micro-batch/DP shards sum to the full-batch loss.
"""

from rlhf.algo.actor_loss import ActorLossInputs, ActorLossMetrics, actor_loss
from rlhf.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    AdvantageKind,
    AdvantageResult,
    compute_advantages,
    scores_to_token_rewards,
)
from rlhf.algo.aggregation import GlobalCounts, LossAggMode, aggregate_loss
from rlhf.algo.entropy import entropy_from_logits
from rlhf.algo.groups import Groups
from rlhf.algo.kl import (
    KL_ESTIMATORS,
    KLConfig,
    KLController,
    KLControllerKind,
    KLEstimator,
    KLInReward,
    apply_kl_in_reward,
    kl_loss,
    kl_penalty,
)
from rlhf.algo.masked import masked_mean_var, masked_whiten
from rlhf.algo.policy_loss import POLICY_LOSSES, PolicyLossConfig, PolicyLossKind, PolicyLossMetrics, policy_loss
from rlhf.algo.running_stats import RunningMeanStd
from rlhf.algo.value_loss import ValueLossConfig, ValueLossMetrics, explained_variance, value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "POLICY_LOSSES", "ActorLossInputs", "ActorLossMetrics", "AdvantageConfig",
    "AdvantageInputs", "AdvantageKind", "AdvantageResult", "GlobalCounts", "Groups", "KLConfig", "KLController",
    "KLControllerKind", "KLEstimator", "KLInReward", "LossAggMode", "PolicyLossConfig", "PolicyLossKind",
    "PolicyLossMetrics", "RunningMeanStd", "ValueLossConfig", "ValueLossMetrics", "actor_loss", "aggregate_loss",
    "apply_kl_in_reward", "compute_advantages", "entropy_from_logits", "explained_variance", "kl_loss",
    "kl_penalty", "masked_mean_var", "masked_whiten", "policy_loss", "scores_to_token_rewards",
    "value_loss",
]

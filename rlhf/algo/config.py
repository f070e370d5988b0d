"""Config sections of the RL algorithms (estimators, losses, KL, rollout correction, DAPO), free of torch.

The implementing modules (advantages.py, policy_loss.py, kl.py, ...) import their section and enum from here, so
a config is loaded and checked without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

from rlhf.algo.registry import parse_kind
from rlhf.errors import ConfigError


class LossAggMode(StrEnum):
    """How per-token losses become one scalar (verl names)."""

    TOKEN_MEAN = "token-mean"  # sum over all tokens / global tokens
    TOKEN_SUM = "token-sum"  # sum over all tokens of the global batch, unnormalised (scale with the lr)
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"  # per-sequence token sum, mean over global sequences
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"  # per-sequence token mean, mean over global sequences
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"  # token sum / constant length, mean over sequences


def parse_agg_mode(mode: str | LossAggMode, norm_length: int | None) -> LossAggMode:
    """Validate a mode (and the constant length seq-mean-token-sum-norm needs) from config."""
    member = parse_kind(LossAggMode, mode, "loss aggregation mode")
    if member is LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM and (norm_length is None or norm_length < 1):
        raise ConfigError(f"loss aggregation 'seq-mean-token-sum-norm' needs a constant agg_norm_length >= 1 "
                          f"(e.g. the max response length), got {norm_length!r}")
    return member


class AdvantageKind(StrEnum):
    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce_plus_plus"
    REINFORCE_PP_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"


@dataclass(kw_only=True)
class AdvantageConfig:
    """Which estimator and its knobs. `whiten` applies to GAE and both REINFORCE++ variants."""

    # the estimator, which picks the algorithm (gae = PPO with a critic; alias ppo)
    kind: AdvantageKind = AdvantageKind.GRPO
    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 1.0  # GAE lambda
    norm_by_std: bool = True  # GRPO: divide by the group std; False is Dr.GRPO
    whiten: bool = True  # batch-whiten advantages (GAE, REINFORCE++, REINFORCE++-baseline)
    eps: float = 1e-6  # GRPO std epsilon

    def __post_init__(self) -> None:
        self.kind = parse_kind(AdvantageKind, self.kind, "advantage estimator", aliases={"ppo": AdvantageKind.GAE})
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"advantage gamma must be in (0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"advantage lam must be in [0, 1], got {self.lam}")
        if self.eps <= 0.0:
            raise ConfigError(f"advantage eps must be > 0, got {self.eps}")


class PolicyLossKind(StrEnum):
    PPO = "ppo"
    GSPO = "gspo"


@dataclass(kw_only=True)
class PolicyLossConfig:
    """Ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO clip-higher: clip_high > clip_low).

    clip_ratio_c: dual-clip bound for negative advantages (> 1), None to disable. Not used by GSPO.
    """

    kind: PolicyLossKind = PolicyLossKind.PPO  # ppo: token ratio clip; gspo: sequence-level ratio (GSPO)
    clip_low: float = 0.2  # ratio lower clip: 1 - clip_low
    clip_high: float = 0.2  # ratio upper clip: 1 + clip_high (DAPO clip-higher)
    clip_ratio_c: float | None = 3.0  # dual-clip bound for negative advantages (> 1); null: off
    agg: LossAggMode = LossAggMode.TOKEN_MEAN  # how per-token losses become one scalar (verl names)
    agg_norm_length: int | None = None  # constant length for seq-mean-token-sum-norm
    entropy_coef: float = 0.0  # entropy bonus weight (subtracted from the loss)

    def __post_init__(self) -> None:
        self.kind = parse_kind(PolicyLossKind, self.kind, "policy loss")
        self.agg = parse_agg_mode(self.agg, self.agg_norm_length)
        if not 0.0 <= self.clip_low < 1.0:
            raise ConfigError(f"policy clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ConfigError(f"policy clip_high must be >= 0, got {self.clip_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ConfigError(f"policy clip_ratio_c (dual-clip) must be > 1.0 or None, got {self.clip_ratio_c}")
        if self.entropy_coef < 0.0:
            raise ConfigError(f"policy entropy_coef must be >= 0, got {self.entropy_coef}")


class KLEstimator(StrEnum):
    K1 = "k1"
    ABS = "abs"
    K2 = "k2"
    K3 = "k3"


KL_ESTIMATOR_ALIASES = {"kl": KLEstimator.K1, "mse": KLEstimator.K2, "low_var_kl": KLEstimator.K3}


class KLControllerKind(StrEnum):
    FIXED = "fixed"
    ADAPTIVE = "adaptive"


@dataclass(kw_only=True)
class KLConfig:
    """KL to the reference policy: a per-token reward penalty (`in_reward`) or a loss term; coef 0 is off.

    The adaptive controller (Ziegler et al.) moves the reward coefficient toward `target` KL over `horizon`
    samples; it only applies to the in-reward penalty.
    """

    estimator: KLEstimator = KLEstimator.K3  # KL estimator (aliases kl, mse, low_var_kl)
    straight_through: bool = False  # keep the estimator's value but take the k2 gradient (loss term only)
    coef: float = 0.0  # KL weight; 0 is off (and no reference model is built)
    in_reward: bool = False  # penalise the per-token reward instead of adding a loss term
    # fixed coefficient, or adaptive (in-reward only) toward `target`
    controller: KLControllerKind = KLControllerKind.FIXED
    target: float | None = None  # adaptive controller: target KL
    horizon: int | None = None  # adaptive controller: samples per adjustment
    agg: LossAggMode = LossAggMode.TOKEN_MEAN  # aggregation of the KL loss term
    agg_norm_length: int | None = None  # constant length for seq-mean-token-sum-norm

    def __post_init__(self) -> None:
        self.estimator = parse_kind(KLEstimator, self.estimator, "KL estimator", KL_ESTIMATOR_ALIASES)
        self.controller = parse_kind(KLControllerKind, self.controller, "KL controller")
        self.agg = parse_agg_mode(self.agg, self.agg_norm_length)
        if self.coef < 0.0:
            raise ConfigError(f"KL coef must be >= 0, got {self.coef}")
        if self.controller is KLControllerKind.ADAPTIVE:
            if not self.in_reward:
                raise ConfigError("KL controller 'adaptive' only applies to the in-reward penalty; "
                                  "set in_reward=true or controller=fixed")
            if self.target is None or self.target <= 0.0 or self.horizon is None or self.horizon <= 0:
                raise ConfigError(f"KL controller 'adaptive' needs target > 0 and horizon > 0, "
                                  f"got target={self.target} horizon={self.horizon}")
        if self.in_reward and self.straight_through:
            raise ConfigError("KL straight_through only affects gradients, so it is meaningless with "
                              "in_reward=true; use it with the KL loss term")

    @property
    def use_in_reward(self) -> bool:
        return self.in_reward and self.coef > 0.0

    @property
    def use_as_loss(self) -> bool:
        return not self.in_reward and self.coef > 0.0


@dataclass(kw_only=True)
class ValueLossConfig:
    """New values are clipped to old_values +- clip_range_value (None disables clipping)."""

    clip_range_value: float | None = 0.5  # new values clipped to old +- this; null: no clipping
    agg: LossAggMode = LossAggMode.TOKEN_MEAN  # how per-token value losses become one scalar
    agg_norm_length: int | None = None  # constant length for seq-mean-token-sum-norm

    def __post_init__(self) -> None:
        self.agg = parse_agg_mode(self.agg, self.agg_norm_length)
        if self.clip_range_value is not None and self.clip_range_value <= 0.0:
            raise ConfigError(f"clip_range_value must be > 0 or None, got {self.clip_range_value}")


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

    enable: bool | Literal["auto"] = "auto"  # auto: on when the engine does not sample with the actor's own tensors
    # importance-weight level (TIS at token level); null: no weights
    rollout_is: CorrectionLevel | None = CorrectionLevel.TOKEN
    rollout_is_threshold: float = 2.0  # IS weights are truncated at this value
    # rejection level: tokens / rows outside the band leave the loss; null: off
    rollout_rs: CorrectionLevel | None = None
    rollout_rs_threshold: float | None = None  # upper bound of the rejection band; null: rollout_is_threshold
    rollout_rs_threshold_lower: float | None = None  # lower bound of the band; null: 1 / upper
    bypass_mode: bool = False  # the rollout logprobs are the PPO anchor (no old-logprob forward)

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
class FilterGroupsConfig:
    """`max_num_gen_batches`: generation rounds per step at most (1 = no regeneration); a step that is still
    short then fills up with dropped groups (zero advantage) so the batch keeps its configured size."""

    enable: bool = False  # DAPO dynamic sampling: drop groups whose rewards are all equal and regenerate
    max_num_gen_batches: int = 10  # generation rounds per step at most (1: no regeneration)

    def __post_init__(self) -> None:
        if self.max_num_gen_batches < 1:
            raise ConfigError(f"algo.filter_groups.max_num_gen_batches={self.max_num_gen_batches} must be >= 1")


@dataclass(kw_only=True)
class OverlongBufferConfig:
    """`len` 0 is off; else responses longer than max_new_tokens - len lose up to `penalty_factor` reward."""

    len: int = 0  # the last `len` tokens before max_new_tokens are penalised linearly; 0 is off
    penalty_factor: float = 1.0  # reward lost at max_new_tokens

    def __post_init__(self) -> None:
        if self.len < 0 or self.penalty_factor < 0:
            raise ConfigError(f"algo.overlong_buffer len={self.len} and penalty_factor={self.penalty_factor} "
                              "must be >= 0")

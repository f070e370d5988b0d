"""Config sections of the RL algorithms (estimators, losses, KL, DAPO), free of torch; rollout correction's is in
correction_config.py.

The implementing modules (advantages.py, policy_loss.py, kl.py, ...) import their section and enum from here, so
a config is loaded and checked without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
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
    OPO = "opo"  # length-weighted group baseline (arXiv 2505.23585)
    GPG = "gpg"  # group mean baseline, rescaled by B / rewarded samples (arXiv 2504.02546)
    GRPO_PASSK = "grpo_passk"  # only each group's best sample: r_max - r_second (arXiv 2503.19595)
    GDPO = "gdpo"  # GRPO per reward component, weighted sum, batch-whitened (arXiv 2601.05242)
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"  # per-token variance-weighted group baseline (arXiv 2602.07078)


@dataclass(kw_only=True)
class AdvantageConfig:
    """Which estimator and its knobs. `whiten` applies to GAE and both REINFORCE++ variants. Papers: GRPO arXiv
    2402.03300 (Dr.GRPO 2503.20783), RLOO 2402.14740, REINFORCE++ 2501.03262, ReMax 2310.10505, OPO 2505.23585,
    GPG 2504.02546, pass@k 2503.19595, GDPO 2601.05242, optimal token baseline 2602.07078 (it needs the actor's
    per-token sum of squared probabilities)."""

    # the estimator, which picks the algorithm (gae = PPO with a critic; alias ppo)
    kind: AdvantageKind = AdvantageKind.GRPO
    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 1.0  # GAE lambda
    norm_by_std: bool = True  # GRPO: divide by the group std; False is Dr.GRPO
    whiten: bool = True  # batch-whiten advantages (GAE, REINFORCE++, REINFORCE++-baseline)
    eps: float = 1e-6  # GRPO std epsilon
    # GDPO: reward components, keys of the dict the rule reward returns beside its total "score" (a plain float is
    # the component "score"); verl's algorithm.gdpo_reward_keys
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None  # GDPO: weight per component; null: all 1

    def __post_init__(self) -> None:
        self.kind = parse_kind(AdvantageKind, self.kind, "advantage estimator", aliases={"ppo": AdvantageKind.GAE})
        if self.kind is AdvantageKind.GDPO and not self.gdpo_reward_keys:
            raise ConfigError("advantage estimator 'gdpo' normalises each reward component on its own: list them "
                              "in algo.advantage.gdpo_reward_keys (e.g. [format_reward, accuracy_reward])")
        if self.gdpo_reward_weights is not None and len(self.gdpo_reward_weights) != len(self.gdpo_reward_keys or []):
            raise ConfigError(f"algo.advantage.gdpo_reward_weights has {len(self.gdpo_reward_weights)} entries for "
                              f"{len(self.gdpo_reward_keys or [])} gdpo_reward_keys; give one weight per key")
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"advantage gamma must be in (0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"advantage lam must be in [0, 1], got {self.lam}")
        if self.eps <= 0.0:
            raise ConfigError(f"advantage eps must be > 0, got {self.eps}")


class PolicyLossKind(StrEnum):
    PPO = "ppo"  # clipped ratio, dual clip (verl: vanilla)
    GSPO = "gspo"  # sequence geometric-mean ratio, clipped (arXiv 2507.18071)
    CISPO = "cispo"  # REINFORCE weighted by the clipped, detached ratio (arXiv 2506.13585)
    GEO_MEAN = "geo_mean"  # GMPO: geometric mean of token-clipped ratios x sequence advantage (arXiv 2507.20673)
    SAPO = "sapo"  # sigmoid-gated ratio instead of a clip (arXiv 2511.20347)
    GPG = "gpg"  # plain -A log pi (arXiv 2504.02546)
    CLIP_COV = "clip_cov"  # PPO; a few high-covariance tokens lose their gradient (arXiv 2505.22617)
    KL_COV = "kl_cov"  # unclipped ratio; top-covariance tokens get a |log ratio| penalty (arXiv 2505.22617)
    DPPO_TV = "dppo_tv"  # masks tokens whose probability moved more than a TV bound (arXiv 2602.04879)
    DPPO_KL = "dppo_kl"  # masks tokens whose binary KL exceeds a bound (arXiv 2602.04879)


POLICY_LOSS_ALIASES = {"vanilla": PolicyLossKind.PPO, "gmpo": PolicyLossKind.GEO_MEAN}


@dataclass(kw_only=True)
class PolicyLossConfig:
    """Ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO clip-higher: clip_high > clip_low); GMPO clips the
    log-ratio to [-clip_low, clip_high]; DPPO reads clip_low/clip_high as its divergence bounds (verl's keys).
    Every kind honours `agg` with global counts and the rollout-correction weights (verl hard-codes
    seq-mean-token-mean for GSPO and SAPO and a micro-batch row mean for GMPO: set `agg` to match). Papers (arXiv):
    PPO 1707.06347, dual clip 1912.09729, DAPO clip-higher 2503.14476, GSPO 2507.18071, CISPO 2506.13585,
    GMPO 2507.20673, SAPO 2511.20347, GPG 2504.02546, Clip-Cov / KL-Cov 2505.22617, DPPO 2602.04879."""

    # the loss (aliases vanilla = ppo, gmpo = geo_mean)
    kind: PolicyLossKind = PolicyLossKind.PPO
    clip_low: float = 0.2  # ratio lower clip: 1 - clip_low (DPPO: divergence bound for A <= 0)
    clip_high: float = 0.2  # ratio upper clip: 1 + clip_high (DAPO clip-higher; DPPO: bound for A > 0)
    # dual-clip bound for negative advantages (> 1; DPPO: truncation of its detached ratio); null: off
    clip_ratio_c: float | None = 3.0
    tau_pos: float = 1.0  # SAPO gate temperature for A > 0
    tau_neg: float = 1.05  # SAPO gate temperature for A <= 0
    clip_cov_ratio: float = 0.0002  # Clip-Cov: fraction of response tokens whose gradient is detached
    clip_cov_lb: float = 1.0  # Clip-Cov: candidates have covariance above this
    clip_cov_ub: float = 5.0  # Clip-Cov: ... and below this
    kl_cov_ratio: float = 0.0002  # KL-Cov: fraction of response tokens (highest covariance) that are penalised
    ppo_kl_coef: float = 0.1  # KL-Cov: weight of the |log ratio| penalty
    agg: LossAggMode = LossAggMode.TOKEN_MEAN  # how per-token losses become one scalar (verl names)
    agg_norm_length: int | None = None  # constant length for seq-mean-token-sum-norm
    entropy_coef: float = 0.0  # entropy bonus weight (subtracted from the loss)

    def __post_init__(self) -> None:
        self.kind = parse_kind(PolicyLossKind, self.kind, "policy loss", POLICY_LOSS_ALIASES)
        self.agg = parse_agg_mode(self.agg, self.agg_norm_length)
        if not 0.0 <= self.clip_low < 1.0:
            raise ConfigError(f"policy clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ConfigError(f"policy clip_high must be >= 0, got {self.clip_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ConfigError(f"policy clip_ratio_c (dual-clip) must be > 1.0 or None, got {self.clip_ratio_c}")
        if self.entropy_coef < 0.0:
            raise ConfigError(f"policy entropy_coef must be >= 0, got {self.entropy_coef}")
        if not (self.tau_pos > 0.0 and self.tau_neg > 0.0):
            raise ConfigError(f"policy tau_pos={self.tau_pos} and tau_neg={self.tau_neg} (SAPO) must be > 0")
        if not (0.0 < self.clip_cov_ratio <= 1.0 and 0.0 < self.kl_cov_ratio <= 1.0):
            raise ConfigError(f"policy clip_cov_ratio={self.clip_cov_ratio} and kl_cov_ratio={self.kl_cov_ratio} "
                              "are token fractions in (0, 1]")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ConfigError(f"policy clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub}")
        if self.ppo_kl_coef < 0.0:
            raise ConfigError(f"policy ppo_kl_coef (KL-Cov) must be >= 0, got {self.ppo_kl_coef}")


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

"""`algo.rollout_correction` at verl 0.9.1's API (IS level + threshold, rejection options + bands, bypass, loss type).

Ratios (log space, per token): rho = pi_old / pi_rollout in decoupled mode, pi_theta / pi_rollout in bypass mode.
Rejection options are verl's `<level>_<estimator>` names; `k1` keeps a band on the INVERSE ratio pi_rollout / pi_old
(verl's k1 statistic is -log rho), `k2` (0.5 log^2 rho) and `k3` (rho - 1 - log rho) an upper bound. rlhf's earlier
level names (token | sequence | geometric, band on rho itself) stay accepted and are translated to the k1 options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal, NamedTuple

from rlhf.algo.registry import parse_kind
from rlhf.errors import ConfigError


class CorrectionLevel(StrEnum):
    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"  # rlhf extension: exp(mean_t log rho) per row


class RejectionOption(StrEnum):
    """verl 0.9.1's rejection statistics: level (token, row sum, row mean, row max) x KL estimator."""

    TOKEN_K1 = "token_k1"
    TOKEN_K2 = "token_k2"
    TOKEN_K3 = "token_k3"
    SEQ_SUM_K1 = "seq_sum_k1"
    SEQ_SUM_K2 = "seq_sum_k2"
    SEQ_SUM_K3 = "seq_sum_k3"
    SEQ_MEAN_K1 = "seq_mean_k1"
    SEQ_MEAN_K2 = "seq_mean_k2"
    SEQ_MEAN_K3 = "seq_mean_k3"
    SEQ_MAX_K2 = "seq_max_k2"
    SEQ_MAX_K3 = "seq_max_k3"


# rlhf's earlier spelling: a level whose band bounded rho = pi_old / pi_rollout
LEGACY_REJECTION_LEVELS = {"token": RejectionOption.TOKEN_K1, "sequence": RejectionOption.SEQ_SUM_K1,
                           "geometric": RejectionOption.SEQ_MEAN_K1}


class BypassLossType(StrEnum):
    PPO_CLIP = "ppo_clip"  # the configured policy loss anchored at pi_rollout; its ratio is the correction
    REINFORCE = "reinforce"  # -A * w * log pi_theta with the IS weights w = pi_theta / pi_rollout (detached)


class RejectionRule(NamedTuple):
    """One parsed rejection option: k1 keeps lower <= statistic-ratio <= upper; k2/k3 keep statistic <= upper."""

    option: RejectionOption
    upper: float
    lower: float | None  # k1 only


def parse_band(spec: str | float, what: str) -> tuple[float, float | None]:
    """(upper, lower) of a threshold written as a number or verl's "lower_upper" string; lower None if absent."""
    text = str(spec).strip()
    lower_text, _, upper_text = text.rpartition("_") if "_" in text else ("", "", text)
    try:
        upper = float(upper_text)
        lower = float(lower_text) if lower_text else None
    except ValueError:
        raise ConfigError(f"{what}={spec!r} must be a number or a 'lower_upper' band such as '0.5_5.0'") from None
    if isinstance(spec, bool) or not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ConfigError(f"{what}={spec!r} needs 0 < lower <= upper (a band 'lower_upper' or an upper bound > 0)")
    return upper, lower


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """Rollout != training numerics. `enable`: auto = on exactly when the rollout engine does not sample with the
    actor's own parameter tensors (a resharded copy, another dtype, vllm/hf); there rlhf applies token TIS at 2
    (verl 0.9.1 ships it off: rollout_is null). Both null with enable=true: metrics only. Rejected tokens leave the
    actor's loss (policy, entropy, KL-loss terms and their counts) but not the advantages or the critic's loss.
    Background: arXiv 2512.23075 (rollout-training mismatch), decoupled PPO 2110.00641."""

    enable: bool | Literal["auto"] = "auto"  # auto: on when the engine does not sample with the actor's own tensors
    # IS weight level (token: TIS; sequence: prod_t rho_t; geometric: exp(mean_t log rho_t)); null: no weights
    rollout_is: CorrectionLevel | None = CorrectionLevel.TOKEN
    # bound on the IS weight at its level (rho = pi_old/pi_rollout): a number truncates (TIS); a band
    # "lower_upper" (e.g. "0.5_5.0") zeroes weights outside it and keeps the tokens (IcePop)
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False  # divide the IS weights by their global-batch mean (tokens or rows)
    # rejection options, comma-separated, all must pass: token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3,
    # seq_max_k2|k3 (k1 bounds pi_rollout/pi_old at its level, k2/k3 cap a KL estimate); legacy
    # token|sequence|geometric bound pi_old/pi_rollout; null: off
    rollout_rs: str | None = None
    # per option (one shared or one each, comma-separated): k1 "lower_upper" or upper (lower = 1/upper) on
    # pi_rollout/pi_old; k2/k3 an upper bound; legacy levels: upper bound on pi_old/pi_rollout
    # (null: rollout_is_threshold)
    rollout_rs_threshold: float | str | None = None
    # legacy levels only: lower bound on pi_old/pi_rollout (null: 1/upper)
    rollout_rs_threshold_lower: float | None = None
    bypass_mode: bool = False  # the rollout log-probs are the old ones (no old-logprob forward); weights use pi_theta
    # bypass only: ppo_clip (the configured policy loss at pi_rollout) | reinforce (-A w log pi, w the IS weights)
    loss_type: BypassLossType = BypassLossType.PPO_CLIP

    def __post_init__(self) -> None:
        if self.enable not in (True, False, "auto"):
            raise ConfigError(f"algo.rollout_correction.enable={self.enable!r} must be auto, true or false")
        if self.rollout_is is not None:
            self.rollout_is = parse_kind(CorrectionLevel, self.rollout_is, "rollout_correction.rollout_is")
        self.loss_type = parse_kind(BypassLossType, self.loss_type, "rollout_correction.loss_type")
        self.is_band()
        self.rejection_rules()
        if self.bypass_mode and self.rollout_is_batch_normalize:
            raise ConfigError("algo.rollout_correction.rollout_is_batch_normalize needs the whole batch's weights, "
                              "but bypass mode computes them per micro-batch from the current policy; set it false "
                              "or bypass_mode=false")
        if self.bypass_mode and self.rollout_is is not None and self.loss_type is BypassLossType.PPO_CLIP:
            raise ConfigError("algo.rollout_correction.bypass_mode=true anchors PPO at the rollout log-probs (its "
                              "ratio pi_theta/pi_rollout is the correction), so rollout_is has no effect with "
                              "loss_type=ppo_clip; set rollout_is null, or loss_type=reinforce to weight REINFORCE "
                              "by it")
        if not self.bypass_mode and self.loss_type is not BypassLossType.PPO_CLIP:
            raise ConfigError(f"algo.rollout_correction.loss_type={self.loss_type.value} applies in bypass mode only; "
                              "set bypass_mode=true or loss_type=ppo_clip")

    def is_band(self) -> tuple[float, float | None]:
        """(upper, lower) of the IS weights: lower None is truncation at upper (TIS), else IcePop's band."""
        return parse_band(self.rollout_is_threshold, "algo.rollout_correction.rollout_is_threshold")

    def rejection_rules(self) -> list[RejectionRule]:
        """The rejection options with their bands in verl 0.9.1's semantics (legacy levels translated)."""
        if self.rollout_rs is None:
            return []
        names = list(dict.fromkeys(name.strip() for name in str(self.rollout_rs).split(",") if name.strip()))
        if not names:
            raise ConfigError("algo.rollout_correction.rollout_rs is empty; name an option such as token_k1 or null")
        legacy = [name for name in names if name in LEGACY_REJECTION_LEVELS]
        if legacy:
            if len(names) > 1:
                raise ConfigError(f"algo.rollout_correction.rollout_rs={self.rollout_rs!r} mixes the legacy level "
                                  f"{legacy[0]!r} with other options; write verl's names (token_k1, seq_sum_k1, ...)")
            return [self._legacy_rule(legacy[0])]
        if self.rollout_rs_threshold_lower is not None:
            raise ConfigError("algo.rollout_correction.rollout_rs_threshold_lower belongs to the legacy levels "
                              "(token|sequence|geometric); with verl's options write the band in rollout_rs_threshold "
                              "as 'lower_upper' on pi_rollout/pi_old")
        options = [parse_kind(RejectionOption, name, "rollout_correction.rollout_rs option") for name in names]
        if self.rollout_rs_threshold is None:
            raise ConfigError(f"algo.rollout_correction.rollout_rs={self.rollout_rs!r} needs rollout_rs_threshold "
                              "(e.g. '0.5_2.0' for k1 options, 0.01 for k2/k3)")
        specs = [spec.strip() for spec in str(self.rollout_rs_threshold).split(",") if spec.strip()]
        if len(specs) not in (1, len(options)):
            raise ConfigError(f"algo.rollout_correction.rollout_rs_threshold={self.rollout_rs_threshold!r} gives "
                              f"{len(specs)} thresholds for {len(options)} options; give one shared or one each")
        specs = specs * len(options) if len(specs) == 1 else specs
        return [self._rule(option, spec) for option, spec in zip(options, specs)]

    def _rule(self, option: RejectionOption, spec: str) -> RejectionRule:
        upper, lower = parse_band(spec, f"algo.rollout_correction.rollout_rs_threshold for {option.value}")
        if option.value.endswith("k1"):
            return RejectionRule(option=option, upper=upper, lower=lower if lower is not None else 1.0 / upper)
        if lower is not None:
            raise ConfigError(f"algo.rollout_correction.rollout_rs_threshold={spec!r} for {option.value} must be a "
                              "single upper bound on the KL estimate (bands are for k1 options)")
        return RejectionRule(option=option, upper=upper, lower=None)

    def _legacy_rule(self, level: str) -> RejectionRule:
        """Legacy band [lower, upper] on rho = pi_old/pi_rollout is verl's k1 band [1/upper, 1/lower] on 1/rho."""
        spec = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        upper, band_lower = parse_band(spec, "algo.rollout_correction.rollout_rs_threshold")
        if band_lower is not None:
            raise ConfigError(f"algo.rollout_correction.rollout_rs={level!r} (legacy level, band on pi_old/pi_rollout) "
                              f"with the band {spec!r} is ambiguous: write rollout_rs={LEGACY_REJECTION_LEVELS[level]} "
                              "for verl's band on pi_rollout/pi_old, or an upper bound with rollout_rs_threshold_lower")
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        if not 0 <= lower <= upper:
            raise ConfigError(f"algo.rollout_correction rejection band [{lower}, {upper}] (rollout_rs_threshold_lower,"
                              " rollout_rs_threshold) needs 0 <= lower <= upper")
        return RejectionRule(option=LEGACY_REJECTION_LEVELS[level], upper=1.0 / lower if lower > 0 else math.inf,
                             lower=1.0 / upper)

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

    @property
    def corrects_in_loss(self) -> bool:
        """Bypass mode with weights, rejection or REINFORCE: the actor's loss computes them per micro-batch."""
        return self.active and self.bypass_mode and (self.rollout_is is not None or self.rollout_rs is not None
                                                     or self.loss_type is BypassLossType.REINFORCE)

import pytest

from rlhf.algo.advantages import ADVANTAGE_ESTIMATORS
from rlhf.algo.config import AdvantageConfig, AdvantageKind, KLEstimator, PolicyLossKind
from rlhf.algo.kl import KL_ESTIMATORS
from rlhf.algo.policy_loss import POLICY_LOSSES
from rlhf.algo.advantages import grpo
from rlhf.algo.registry import Registry
from rlhf.errors import ConfigError


def test_every_kind_is_registered():
    assert ADVANTAGE_ESTIMATORS.kinds() == list(AdvantageKind)
    assert POLICY_LOSSES.kinds() == list(PolicyLossKind)
    assert KL_ESTIMATORS.kinds() == list(KLEstimator)


def test_lookup_by_name_and_enum_give_the_same_function():
    assert ADVANTAGE_ESTIMATORS.get("grpo") is grpo
    assert ADVANTAGE_ESTIMATORS.get(AdvantageKind.GRPO) is grpo


def test_unknown_estimator_name_is_a_config_error_with_a_hint():
    with pytest.raises(ConfigError) as err:
        AdvantageConfig(kind="grop")
    assert str(err.value) == (
        "unknown advantage estimator 'grop' (did you mean 'grpo'?); choose one of: gae, grpo, rloo, "
        "reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo, gpg, grpo_passk, gdpo, "
        "optimal_token_baseline, ppo")
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'grpo_pass_k' \(did you mean 'grpo_passk'\?\)"):
        AdvantageConfig(kind="grpo_pass_k")
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'optimal_token_baselin' \(did you mean "
                                          r"'optimal_token_baseline'\?\)"):
        AdvantageConfig(kind="optimal_token_baselin")
    with pytest.raises(ConfigError, match="unknown advantage estimator 'ppo2'"):
        ADVANTAGE_ESTIMATORS.get("ppo2")


def test_config_string_becomes_the_enum():
    config = AdvantageConfig(kind="reinforce_plus_plus")
    assert config.kind is AdvantageKind.REINFORCE_PP


def test_registered_kind_without_implementation_is_reported():
    registry = Registry(AdvantageKind, "toy estimator")
    with pytest.raises(ConfigError, match="toy estimator 'gae' has no implementation registered"):
        registry.get("gae")

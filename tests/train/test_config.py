"""OptimConfig validation: every bad value is a ConfigError naming the field and the fix."""

from __future__ import annotations

import pytest

from rlhf.errors import ConfigError
from rlhf.train.config import OptimConfig


@pytest.mark.parametrize("kwargs, message", [
    ({"lr": 0.0}, "optim.lr=0.0 must be > 0"),
    ({"lr": 1e-3, "min_lr": 1e-2}, "optim.min_lr=0.01 must be in [0, optim.lr=0.001]"),
    ({"betas": (0.9, 1.0)}, "optim.betas=[0.9, 1.0] must be two numbers in [0, 1)"),
    ({"decay_style": "exp"}, "optim.decay_style='exp' is not one of constant, linear, cosine"),
    ({"nan_policy": "ignore"}, "optim.nan_policy='ignore' is not one of skip, abort"),
    ({"warmup_steps": 5, "total_steps": 5}, "optim.warmup_steps=5 must be < optim.total_steps=5"),
    ({"clip_grad": -1.0}, "optim.clip_grad=-1.0 must be >= 0 (0 disables clipping)"),
    ({"total_steps": -1}, "optim.total_steps=-1 must be >= 0 (0: the trainer's step count)"),
])
def test_bad_values_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as error:
        OptimConfig(**kwargs)
    assert str(error.value) == message


def test_total_steps_comes_from_config_or_trainer():
    assert OptimConfig(total_steps=7).resolved_total_steps(100) == 7
    assert OptimConfig().resolved_total_steps(100) == 100
    with pytest.raises(ConfigError, match="set optim.total_steps"):
        OptimConfig().resolved_total_steps(None)
    with pytest.raises(ConfigError, match="optim.warmup_steps=10 must be < the 10 total steps"):
        OptimConfig(warmup_steps=10).resolved_total_steps(10)


def test_loads_through_the_config_loader():
    from rlhf.config.loader import from_dict, to_dict

    config = from_dict(OptimConfig, {"betas": [0.9, 0.95], "decay_style": "cosine", "total_steps": 10})
    assert config.betas == (0.9, 0.95) and config.decay_style == "cosine"
    assert from_dict(OptimConfig, to_dict(config)) == config
    with pytest.raises(ConfigError, match="unknown config key 'lrr'; did you mean 'lr'"):
        from_dict(OptimConfig, {"lrr": 1e-3})

"""The `data` config section validates itself and loads through the YAML/override loader."""

import pytest

from rlhf.config.loader import from_dict
from rlhf.data.config import DataConfig
from rlhf.errors import ConfigError


@pytest.mark.parametrize("kwargs, message", [
    ({"max_prompt_length": 0}, "data.max_prompt_length=0 must be >= 1"),
    ({"truncation": "middle"}, "data.truncation='middle' is not one of error, filter, left, right"),
    ({"prompts_per_step": 0}, "data.prompts_per_step=0 must be >= 1"),
    ({"seed": -3}, "data.seed=-3 must be >= 0"),
])
def test_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**kwargs)


def test_loads_from_a_mapping():
    config = from_dict(DataConfig, {"train_files": ["a.parquet"], "truncation": "left", "max_prompt_length": 64},
                       "data")
    assert config == DataConfig(train_files=["a.parquet"], truncation="left", max_prompt_length=64)
    with pytest.raises(ConfigError, match="data.truncation='middle' is not one of 'error', 'filter'"):
        from_dict(DataConfig, {"truncation": "middle"}, "data")
    with pytest.raises(ConfigError, match="unknown config key 'data.max_prompt_len'; did you mean 'max_prompt_length'"):
        from_dict(DataConfig, {"max_prompt_len": 3}, "data")

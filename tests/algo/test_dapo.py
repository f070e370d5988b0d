import pytest
import torch

from rlhf.algo.dapo import OverlongBufferConfig, informative_rows, overlong_penalty
from rlhf.algo.config import FilterGroupsConfig
from rlhf.errors import ConfigError


def test_overlong_penalty_is_linear_in_the_buffer_before_the_max_length():
    lengths = torch.tensor([1, 6, 7, 8, 9, 10])
    penalty = overlong_penalty(lengths, 10, OverlongBufferConfig(len=4, penalty_factor=0.5))
    # free up to 10 - 4 = 6 tokens, then -0.5 * excess / 4
    assert penalty.tolist() == [0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    assert penalty.dtype == torch.float32
    assert overlong_penalty(lengths, 10, OverlongBufferConfig()).tolist() == [0.0] * 6


def test_informative_rows_keep_groups_whose_rewards_differ():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 7, 7])
    assert informative_rows(scores, groups).tolist() == [False, False, True, True, False, False, False, False]


def test_bad_config_values():
    with pytest.raises(ConfigError, match=r"^algo.filter_groups.max_num_gen_batches=0 must be >= 1$"):
        FilterGroupsConfig(enable=True, max_num_gen_batches=0)
    with pytest.raises(ConfigError, match=r"^algo.overlong_buffer len=-1 and penalty_factor=1.0 must be >= 0$"):
        OverlongBufferConfig(len=-1)

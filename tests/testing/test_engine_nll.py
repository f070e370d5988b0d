"""Answer-token NLL micro-batching (rlhf.testing.engine_nll): rows per DP rank, the global answer-token count, errors."""

from __future__ import annotations

import pytest
import torch

from rlhf.errors import ConfigError
from rlhf.testing.engine_nll import sft_micro_batches


def test_rows_are_split_per_dp_rank_and_carry_the_global_count():
    tokens = torch.arange(8 * 4).reshape(8, 4)
    mask = torch.zeros(8, 4, dtype=torch.long)
    mask[:, 2:] = 1
    mask[0, 0] = 1  # position 0 is never a target: not counted
    batches = sft_micro_batches(tokens, mask, dp_rank=1, dp_size=2, num_micro_batches=2)
    assert [b.tokens_bs[:, 0].tolist() for b in batches] == [[16, 20], [24, 28]]
    assert all(b.num_global_answer_tokens == 16 for b in batches)


def test_bad_batches_are_config_errors():
    tokens, mask = torch.zeros(6, 4, dtype=torch.long), torch.ones(6, 4, dtype=torch.long)
    with pytest.raises(ConfigError, match="global batch of 6 rows does not split into dp=2 x 2 micro-batches"):
        sft_micro_batches(tokens, mask, dp_rank=0, dp_size=2, num_micro_batches=2)
    mask[:, 1:] = 0
    with pytest.raises(ConfigError, match="no answer tokens"):
        sft_micro_batches(tokens, mask, dp_rank=0, dp_size=1, num_micro_batches=1)

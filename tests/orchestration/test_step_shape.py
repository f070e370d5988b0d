"""The step's shape (DESIGN.md §2, issue 27): frozen payloads between the sides, drivers that only order calls,
a trainer build that only wires the sides together."""

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

from rlhf.orchestration.loop import Trainer
from rlhf.orchestration.step import StepDriver
from rlhf.stages.batch import RolloutBatch, ScoredBatch, SequenceBatch

ROOT = Path(__file__).parents[2] / "rlhf"


def _lines(function) -> int:
    node = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    return node.end_lineno - node.lineno + 1


def test_payloads_are_frozen_and_a_scored_batch_is_a_rollout_batch():
    for payload in (SequenceBatch, RolloutBatch, ScoredBatch):
        assert payload.__dataclass_params__.frozen, payload
    assert issubclass(ScoredBatch, RolloutBatch)
    mask = torch.ones(1, 2, dtype=torch.bool)
    batch = SequenceBatch(tokens_bs=torch.zeros(1, 4, dtype=torch.long), prompt_lengths_b=torch.tensor([2]),
                          response_lengths_b=torch.tensor([2]), response_mask_bt=mask, pad_token_id=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.response_mask_bt = mask


def test_each_driver_is_a_short_ordering_and_the_build_a_short_wiring():
    lengths = {name: _lines(getattr(StepDriver, name)) for name in ("sync", "one_step_off", "replay")}
    assert max(lengths.values()) <= 15, lengths
    assert _lines(Trainer._build) <= 40
    assert not [path for path in ROOT.rglob("*.py") if "RLStack" in path.read_text()]

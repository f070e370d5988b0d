import pytest
import torch

from rlhf.algo.running_stats import RunningMeanStd
from rlhf.errors import RewardError


def _stream():
    return torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3 + 1e4


def test_chunked_updates_match_the_whole_stream():
    data = _stream()
    stats = RunningMeanStd()
    for chunk in data.split(37):
        stats.update(chunk)
    assert stats.count == 1000
    assert stats.mean == pytest.approx(data.mean().item(), rel=1e-12)
    assert stats.var == pytest.approx(data.var(unbiased=False).item(), rel=1e-9)


def test_merge_of_states_equals_one_stream_and_round_trips():
    data = _stream()
    parts = [RunningMeanStd(), RunningMeanStd(), RunningMeanStd()]
    for part, chunk in zip(parts, [data[:10], data[10:600], data[600:]]):
        part.update(chunk)
    merged = RunningMeanStd.merged(torch.stack([p.state() for p in parts]))
    assert merged.mean == pytest.approx(data.mean().item(), rel=1e-12)
    assert merged.std == pytest.approx(data.std(unbiased=False).item(), rel=1e-9)
    assert RunningMeanStd.from_state(merged.state()) == merged
    empty = RunningMeanStd()
    empty.merge(RunningMeanStd())
    assert empty.state().tolist() == [0.0, 0.0, 0.0]


def test_normalize():
    stats = RunningMeanStd()
    stats.update(torch.tensor([1.0, 3.0]))  # mean 2, population std 1
    torch.testing.assert_close(stats.normalize(torch.tensor([4.0])), torch.tensor([2.0]))
    torch.testing.assert_close(stats.normalize(torch.tensor([4.0]), center=False), torch.tensor([4.0]))


def test_nan_is_rejected():
    with pytest.raises(RewardError, match="value for RunningMeanStd is NaN/inf for sample\\(s\\) \\[1\\]"):
        RunningMeanStd().update(torch.tensor([1.0, float("nan")]))

"""Schedules: per-pair buckets respect the size cap, keep plan order, and bucket k of a pair travels in round k."""

from __future__ import annotations

import pytest

from rlhf.parallel.layout import ParallelLayout
from rlhf.reshard.planner import plan_for_model
from rlhf.reshard.schedule import build_schedule
from tests.reshard.test_planner import make_config


@pytest.mark.parametrize("max_numel", [1, 500, 10**9])
def test_buckets_cap_order_and_rounds(max_numel):
    config = make_config("qwen2", 4, 2, 4, 101, tied=True)
    plan = plan_for_model(config, ParallelLayout(tp=2, pp=2), ParallelLayout(tp=1, dp=2, first_rank=4))
    schedule = build_schedule(plan, max_bucket_numel=max_numel)
    assert not schedule.local  # split placement: nothing is local
    by_pair: dict[tuple[int, int], list] = {}
    for index, buckets in enumerate(schedule.rounds):
        assert len({(b.src_rank, b.dst_rank) for b in buckets}) == len(buckets)
        for bucket in buckets:
            pair = by_pair.setdefault((bucket.src_rank, bucket.dst_rank), [])
            assert len(pair) == index  # the pair's k-th bucket is in round k
            pair.append(bucket)
            assert bucket.numel <= max_numel or len(bucket.transfers) == 1
    for (src, dst), buckets in by_pair.items():
        expected = [t for t in plan.transfers if (t.src_rank, t.dst_rank) == (src, dst)]
        assert [t for b in buckets for t in b.transfers] == expected
    if max_numel == 10**9:
        assert len(schedule.rounds) == 1 and schedule.num_messages == len(by_pair)

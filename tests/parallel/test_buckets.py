"""The bucket planner alone: deterministic, per dtype, large tensors alone, offsets contiguous."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.parallel.buckets import TensorSpec, bucket_bytes, canonical_entries, plan_buckets
from rlhf.errors import ConfigError

F32, BF16 = torch.float32, torch.bfloat16


def test_small_tensors_share_a_bucket_per_dtype_and_large_ones_go_alone():
    specs = [TensorSpec("a", (4,), F32), TensorSpec("b", (2,), BF16), TensorSpec("big", (300,), F32),
             TensorSpec("c", (), F32), TensorSpec("d", (0,), F32), TensorSpec("e", (3,), BF16)]
    plan = plan_buckets(specs, min_bucket_bytes=1024)
    assert [(b.dtype, b.entries, b.offsets_elems, b.numel) for b in plan] == [
        (BF16, (1, 5), (0, 2), 5),
        (F32, (2,), (0,), 300),
        (F32, (0, 3, 4), (0, 4, 5), 5),
    ]


def test_bucket_closes_once_it_reaches_the_minimum():
    specs = [TensorSpec(f"t{i}", (100,), F32) for i in range(5)]  # 400 bytes each
    plan = plan_buckets(specs, min_bucket_bytes=1000)
    assert [b.entries for b in plan] == [(0, 1, 2), (3, 4)]


def test_zero_bucket_size_puts_every_tensor_alone():
    specs = [TensorSpec("a", (3,), F32), TensorSpec("b", (0,), F32)]
    assert [b.entries for b in plan_buckets(specs, 0)] == [(0,), (1,)]


def test_dict_entries_are_sorted_by_name_lists_keep_position():
    a, b = torch.zeros(1), torch.ones(2)
    assert canonical_entries({"z": a, "m": b}) == (["m", "z"], [b, a])
    names, tensors = canonical_entries([a, b])
    assert names == ["[0]", "[1]"] and tensors[0] is a


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "1", True])
def test_bad_bucket_size_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"comm.min_bucket_mb=.* must be a finite number >= 0"):
        bucket_bytes(bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 40), max_size=3), st.sampled_from([F32, BF16, torch.int64])),
                max_size=30),
       st.integers(0, 400))
def test_plan_covers_every_tensor_once_with_packed_offsets(shapes_dtypes, min_bytes):
    specs = [TensorSpec(f"t{i}", tuple(shape), dtype) for i, (shape, dtype) in enumerate(shapes_dtypes)]
    plan = plan_buckets(specs, min_bytes)
    assert sorted(i for b in plan for i in b.entries) == list(range(len(specs)))
    for bucket in plan:
        sizes = [specs[i].numel for i in bucket.entries]
        assert all(specs[i].dtype == bucket.dtype for i in bucket.entries)
        assert list(bucket.offsets_elems) == [sum(sizes[:k]) for k in range(len(sizes))]
        assert bucket.numel == sum(sizes)
        assert list(bucket.entries) == sorted(bucket.entries)
        if len(bucket.entries) > 1:
            assert all(specs[i].nbytes < min_bytes for i in bucket.entries)
            assert sum(specs[i].nbytes for i in bucket.entries[:-1]) < min_bytes
    assert plan == plan_buckets(list(specs), min_bytes)

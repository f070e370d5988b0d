"""`huge_pages.empty`: tensors inside an arena are carved from shared 2 MB-aligned chunks (cache-line aligned, never
overlapping, alive after the arena closes); outside one, a tensor of 2 MB or more starts on a huge page and a smaller
one is a plain allocation; without THP every call is a plain `torch.empty`. Packed decode weights and the KV cache
use it."""

import pytest
import torch

from rlhf.platform import huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this machine")


@needs_thp
def test_arena_carves_aligned_disjoint_tensors_that_outlive_it():
    with huge_pages.arena():
        small = [huge_pages.empty(1000 + i) for i in range(5)]
        big = huge_pages.empty(5 << 20)  # 20 MB: the same chunk
        huge = huge_pages.empty(20 << 20)  # 80 MB: a chunk of its own
    assert small[0].data_ptr() % huge_pages.HUGE_PAGE == 0 and huge.data_ptr() % huge_pages.HUGE_PAGE == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in (*small, big))
    assert all(t.data_ptr() % huge_pages.ALIGN == 0 for t in (*small, big, huge))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] - spans[0][0] < huge_pages.CHUNK  # one chunk
    for i, t in enumerate((*small, big, huge)):
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate((*small, big, huge)))
    assert [t.dtype for t in (small[0], big)] == [torch.float32] * 2
    assert huge_pages.empty(3, torch.bfloat16).numel() == 3


@needs_thp
def test_outside_an_arena_only_large_tensors_are_aligned():
    large = huge_pages.zeros(1 << 20, torch.float32, torch.device("cpu"))  # 4 MB
    assert large.data_ptr() % huge_pages.HUGE_PAGE == 0 and bool((large == 0).all()) and large.numel() == 1 << 20
    assert huge_pages.empty(1000).untyped_storage().nbytes() == 4000  # a plain allocation


def test_without_thp_every_call_is_plain(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    with huge_pages.arena():
        carved = huge_pages.empty(1 << 20)
    assert carved.untyped_storage().nbytes() == 4 << 20
    assert huge_pages.empty(0).numel() == 0

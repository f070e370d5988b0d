"""`PeakWindow`: the peak inside each window stays exact when windows nest and overlap and a reset happens in
one of them (the profiler's phases and the trainer's memory phases share one allocator peak)."""

import pytest

from rlhf.platform import device as platform


class _Allocator:
    """A stand-in accelerator allocator: live bytes and a resettable peak."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def alloc(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def free(self, n: int) -> None:
        self.live -= n

    def reset(self) -> None:
        self.peak = self.live


@pytest.fixture
def allocator(monkeypatch):
    fake = _Allocator()
    monkeypatch.setattr(platform, "has_accelerator", lambda: True)
    monkeypatch.setattr(platform.torch.cuda, "reset_peak_memory_stats", fake.reset)
    monkeypatch.setattr(platform.torch.cuda, "max_memory_allocated", lambda: fake.peak)
    return fake


def test_nested_and_overlapping_windows_keep_their_peaks(allocator):
    allocator.alloc(100)
    outer = platform.PeakWindow()
    allocator.alloc(50)  # 150
    allocator.free(50)
    inner = platform.PeakWindow()  # resets the allocator peak: outer must keep its 150
    allocator.alloc(20)  # 120
    allocator.free(20)
    overlapping = platform.PeakWindow()
    assert inner.close() == 120
    allocator.alloc(30)  # 130
    allocator.free(30)
    platform.reset_peak_memory()  # a reset by someone else (e.g. the trainer's memory phase)
    allocator.alloc(5)  # 105
    assert overlapping.close() == 130
    assert outer.close() == 150
    assert platform._OPEN_WINDOWS == []
    allocator.free(5)
    after = platform.PeakWindow()
    assert after.close() == 100  # a window opened later starts from live memory, not the earlier 105 peak


def _child_rss(queue) -> None:
    import psutil

    start = platform.allocated_memory_bytes()
    buffer = b"\x01" * (128 << 20)  # 128 MiB written (mmap'd: fresh pages); no torch after a fork (its threads)
    queue.put((start, platform.allocated_memory_bytes(), psutil.Process().memory_info().rss, len(buffer)))


def test_cpu_resident_bytes_follow_the_process_and_a_fork():
    """On CPU: this process's RSS as psutil reads it (a pread of a kept-open /proc/self/statm); a forked child reads
    its own file, not the parent's inherited descriptor: its 128 MiB show up in what it reads."""
    import multiprocessing

    import psutil

    if platform.has_accelerator():
        pytest.skip("the CPU path")
    assert abs(platform.allocated_memory_bytes() - psutil.Process().memory_info().rss) < 4 << 20
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_rss, args=(queue,))
    child.start()
    start, end, want, _ = queue.get(timeout=120)
    child.join(timeout=120)
    assert end - start > 96 << 20 and abs(end - want) < 4 << 20, (start, end, want)

"""CPU tensors on transparent huge pages (2 MB) where Linux offers them, for memory a decode step streams.

A decode step reads every packed weight and the KV cache from memory once; on 4 KB pages that stream misses the
TLB on every page (SmolLM2-135M: 540 MB of fp32 weights, ~138k pages a step), and software prefetches stall on the
page walks. SmolLM2's decode GEMMs at 32 rows, weights out of cache (AMD EPYC, one thread, a layer's four GEMMs):
1.10 / 0.98 / 1.04 ms on 4 KB pages (it varies with where the pages land) -> 1.06 / 0.95 / 0.95 ms from an arena
here; a whole decode step side by side in one process 43.4 -> 42.7 ms. torch's allocator asks for huge pages only
under `THP_MEM_ALLOC_ENABLE=1`, process-wide and read before its first allocation; this module asks for the
tensors that need them.

`empty(numel, dtype)`: a 1-D CPU tensor in memory aligned to 2 MB and advised MADV_HUGEPAGE before its first touch.
Inside `with arena():` the tensors are carved one after another out of shared chunks (many small packed weights
fill whole huge pages instead of each rounding one up); outside, a tensor below 2 MB is a plain `torch.empty`.
The memory is an anonymous mapping of its own (never reused heap memory), unmapped when its last tensor goes. Where
the kernel has no THP (not Linux, `enabled` is `[never]`, madvise refused) every call is a plain `torch.empty`.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
from collections.abc import Iterator
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # an arena's chunk: a few dozen layers' packed weights
ALIGN = 64  # tensors inside a chunk start on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_arenas: list[_Arena] = []


@functools.cache
def available() -> bool:
    """Whether this machine can be asked for transparent huge pages (Linux with THP not `[never]`)."""
    try:
        return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _advised(nbytes: int) -> torch.Tensor | None:
    """`nbytes` (a multiple of HUGE_PAGE) of fresh anonymous memory starting on a huge page and advised
    MADV_HUGEPAGE, as uint8 (the mapping is unmapped when the last tensor on it goes); None if refused."""
    # private: a shared anonymous mapping is shmem, which THP leaves alone
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = (-whole.data_ptr()) % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except OSError:
        return None
    return whole[offset:offset + nbytes]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Arena:
    def __init__(self) -> None:
        self.chunk: torch.Tensor | None = None
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        if self.chunk is None or self.used + nbytes > self.chunk.numel():
            self.chunk, self.used = _advised(max(CHUNK, _round_up(nbytes, HUGE_PAGE))), 0
            if self.chunk is None:
                return None
        region = self.chunk[self.used:self.used + nbytes]
        self.used += _round_up(nbytes, ALIGN)
        return region


@contextlib.contextmanager
def arena() -> Iterator[None]:
    """`empty` calls inside share chunks; each chunk lives as long as a tensor carved from it."""
    _arenas.append(_Arena())
    try:
        yield
    finally:
        _arenas.pop()


def empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements, uninitialised, on huge pages where available (see the module)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    region = None
    if available() and nbytes > 0:
        if _arenas:
            region = _arenas[-1].take(nbytes)
        elif nbytes >= HUGE_PAGE:
            advised = _advised(_round_up(nbytes, HUGE_PAGE))
            region = None if advised is None else advised[:nbytes]
    return torch.empty(numel, dtype=dtype) if region is None else region.view(dtype)


def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`empty(numel, dtype).zero_()` on CPU (zeroing is the first touch); `torch.zeros` on any other device."""
    if device.type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    return empty(numel, dtype).zero_()

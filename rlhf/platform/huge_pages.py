"""CPU tensors on transparent huge pages (2 MB) where Linux offers them, for memory a decode step streams.

A decode step reads every packed weight and the KV cache from memory once; on 4 KB pages that stream misses the
TLB on every page (SmolLM2-135M: 540 MB of fp32 weights, ~138k pages a step), and software prefetches stall on the
page walks. On 2 MB pages SmolLM2's decode GEMMs at 32 rows ran 1.095 -> 0.968 ms a layer (AMD EPYC, one thread,
weights out of cache). torch's allocator asks for huge pages only under `THP_MEM_ALLOC_ENABLE=1`, process-wide and
read before the first allocation; this module asks for the tensors that need them.

`empty(numel, dtype)`: a 1-D CPU tensor in memory aligned to 2 MB and advised MADV_HUGEPAGE before its first touch.
Inside `with arena():` the tensors are carved one after another out of shared chunks (many small packed weights
fill whole huge pages instead of each rounding one up); outside, a tensor below 2 MB is a plain `torch.empty`.
Where the kernel has no THP (not Linux, `enabled` is `[never]`, madvise refused) every call is a plain `torch.empty`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # an arena's chunk: a few dozen layers' packed weights
ALIGN = 64  # tensors inside a chunk start on a cache line
MADV_HUGEPAGE = 14  # Linux's value (asm-generic/mman-common.h)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_arenas: list[_Arena] = []


@functools.cache
def _madvise():
    """libc's madvise where THP can be asked for, else None."""
    try:
        if "[never]" in THP_SETTING.read_text():
            return None
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def available() -> bool:
    return _madvise() is not None


def _advised(nbytes: int) -> torch.Tensor | None:
    """`nbytes` (a multiple of HUGE_PAGE) of fresh uint8 memory starting on a huge page, advised; None if refused."""
    base = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    region = base[(-base.data_ptr()) % HUGE_PAGE:][:nbytes]
    if _madvise()(region.data_ptr(), nbytes, MADV_HUGEPAGE) != 0:
        return None
    return region


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

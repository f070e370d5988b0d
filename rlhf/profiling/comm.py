"""Counts every torch.distributed collective (calls, payload bytes, wall time), attributed to the open phase.

Patches the functions on `torch.distributed` and `distributed_c10d` while active, so code calling
`dist.all_reduce(...)` (rlhf and megatron-core alike) is seen; code that imported a function by name is not.
Time is the call's wall time: for `async_op=True` calls that is the launch only, the wait lands in the phase.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

# Collective -> index of the positional argument that carries the payload (the input, not the output buffer).
PAYLOAD_ARG = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1, "all_gather_single": 1,
               "reduce_scatter_single": 1, "_all_gather_base": 1, "_reduce_scatter_base": 1,
               "reduce_scatter": 1, "reduce_scatter_tensor": 1, "all_to_all_single": 1, "all_to_all": 1,
               "gather": 0, "scatter": 1, "send": 0, "recv": 0, "isend": 0, "irecv": 0, "barrier": -1,
               "all_gather_object": 1, "broadcast_object_list": 0, "batch_isend_irecv": 0}


@dataclass
class CollectiveStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


def payload_bytes(value) -> int:
    """Bytes of a tensor, or of the tensors in a list (objects and P2P op lists count 0)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value if isinstance(v, torch.Tensor))
    return 0


class CollectiveCounter:
    """Per (phase, collective) stats; `phase_of()` names the phase a call belongs to."""

    def __init__(self, phase_of: Callable[[], str]) -> None:
        self.phase_of = phase_of
        self.stats: dict[tuple[str, str], CollectiveStats] = {}
        self._depth = 0  # all_gather_object & co. call all_gather inside: only the outer call counts

    def _wrap(self, name: str, fn: Callable) -> Callable:
        index = PAYLOAD_ARG[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                stats = self.stats.setdefault((self.phase_of(), name), CollectiveStats())
                stats.calls += 1
                stats.seconds += time.perf_counter() - start
                if 0 <= index < len(args):
                    stats.bytes += payload_bytes(args[index])

        return counted

    @contextmanager
    def active(self) -> Iterator[None]:
        """Count collectives inside the block; the original functions are restored on exit."""
        saved = []
        for name in PAYLOAD_ARG:
            for module in (dist, distributed_c10d):
                original = getattr(module, name, None)
                if original is not None:
                    saved.append((module, name, original))
                    setattr(module, name, self._wrap(name, original))
        try:
            yield
        finally:
            for module, name, original in saved:
                setattr(module, name, original)

    def rows(self) -> list[dict]:
        return [{"phase": phase, "op": op, "calls": s.calls, "bytes": s.bytes, "seconds": s.seconds}
                for (phase, op), s in sorted(self.stats.items())]

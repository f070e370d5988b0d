"""Peak memory per step phase, fed by `StepMetrics.timer` through `rlhf.metrics.TIMER_OBSERVERS`.

On an accelerator: the allocator's peak inside the phase (nested phases fold their peak into the enclosing
ones before resetting). On CPU, where a peak cannot be reset: the larger resident set size at phase entry/exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from rlhf import metrics, platform


def _memory_now() -> int:
    if platform.has_accelerator():
        return platform.peak_memory_bytes()
    return psutil.Process().memory_info().rss


class PhaseMemory:
    """Tracks the open phases and each phase's peak memory (bytes, max over the steps it ran in)."""

    def __init__(self) -> None:
        self.open: list[str] = []
        self._running: dict[str, int] = {}
        self.peak_bytes: dict[str, int] = {}

    def current_phase(self) -> str:
        """The innermost open phase (`step` between phases, `outside` when no step runs)."""
        return self.open[-1] if self.open else "outside"

    def _fold(self) -> None:
        now = _memory_now()
        for name in self.open:
            self._running[name] = max(self._running.get(name, 0), now)
        platform.reset_peak_memory()

    def enter(self, name: str) -> None:
        self._fold()
        self.open.append(name)
        self._running[name] = _memory_now()

    def exit(self, name: str, seconds: float) -> None:
        self._fold()
        assert self.open and self.open[-1] == name, (self.open, name)
        self.open.pop()
        peak = self._running.pop(name)
        self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)

    @contextmanager
    def active(self) -> Iterator[None]:
        metrics.TIMER_OBSERVERS.append(self)
        try:
            yield
        finally:
            metrics.TIMER_OBSERVERS.remove(self)

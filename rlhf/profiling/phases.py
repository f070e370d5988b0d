"""Peak memory per step phase, fed by `StepMetrics.timer` through `rlhf.metrics.TIMER_OBSERVERS`.

Each phase is a `platform.PeakWindow`: on an accelerator the allocator's peak inside the phase (exact under
nesting, and next to the trainer's own memory phases); on CPU, where a peak cannot be reset, the largest
resident set size seen at the phase's entry, exit and the resets in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rlhf import metrics, platform


class PhaseMemory:
    """Tracks the open phases and each phase's peak memory (bytes, max over the steps it ran in)."""

    def __init__(self) -> None:
        self.open: list[tuple[str, platform.PeakWindow]] = []
        self.peak_bytes: dict[str, int] = {}

    def current_phase(self) -> str:
        """The innermost open phase (`step` between phases, `outside` when no step runs)."""
        return self.open[-1][0] if self.open else "outside"

    def enter(self, name: str) -> None:
        self.open.append((name, platform.PeakWindow()))

    def exit(self, name: str, seconds: float) -> None:
        assert self.open and self.open[-1][0] == name, (self.open, name)
        _, window = self.open.pop()
        self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), window.close())

    @contextmanager
    def active(self) -> Iterator[None]:
        metrics.TIMER_OBSERVERS.append(self)
        try:
            yield
        finally:
            metrics.TIMER_OBSERVERS.remove(self)

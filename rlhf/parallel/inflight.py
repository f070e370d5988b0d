"""Which collective this process is inside right now, readable from another thread (the watchdog).

One slot per process, guarded by a lock: collectives enter it, the watchdog only reads it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class InFlight:
    description: str
    started_monotonic: float

    def age_s(self) -> float:
        return time.monotonic() - self.started_monotonic


class _Slot:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: InFlight | None = None

    def get(self) -> InFlight | None:
        with self._lock:
            return self._current

    def swap(self, value: InFlight | None) -> InFlight | None:
        with self._lock:
            previous, self._current = self._current, value
            return previous


_SLOT = _Slot()


def current() -> InFlight | None:
    """The collective in flight on this process, or None."""
    return _SLOT.get()


@contextmanager
def track(description: str) -> Iterator[None]:
    """Mark `description` as in flight for the duration of the block (nested calls restore the outer one)."""
    previous = _SLOT.swap(InFlight(description, time.monotonic()))
    try:
        yield
    finally:
        _SLOT.swap(previous)

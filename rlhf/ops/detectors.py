"""Pure alert detectors over a run's per-step metric history: given numbers in, a finding (or None) out.

Each detector keeps only its own window of past values, so it is unit-tested on crafted sequences and never
reads a clock (throughput is a number the step measured). Every finite value joins its window, spikes
included: median and MAD barely move for one outlier, and a lasting level shift becomes the new normal.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

# MAD of a normal sample is 0.6745 sigma: this makes the robust z-score comparable to a plain one.
_MAD_TO_SIGMA = 0.6745


def robust_z(value: float, history: list[float]) -> float:
    """(value - median) / (MAD / 0.6745) over `history`; 0 when the history has no spread (MAD 0) to judge by,
    e.g. GRPO steps whose groups all scored alike have a loss and grad norm of exactly 0."""
    median = statistics.median(history)
    mad = statistics.median(abs(x - median) for x in history)
    return _MAD_TO_SIGMA * (value - median) / mad if mad > 0 else 0.0


def non_finite(values: dict[str, float], names: tuple[str, ...]) -> list[str]:
    """`name=value` for each of `names` whose value is NaN or inf (names the step lacks are skipped)."""
    return [f"{name}={values[name]}" for name in names if name in values and not math.isfinite(values[name])]


class _Windowed:
    """A detector's window as checkpoint state (plain floats), so a resumed run alerts as the uninterrupted one."""

    history: deque

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(float(v) for v in state["history"])


class SpikeDetector(_Windowed):
    """A value whose robust z-score over the last `window` values exceeds `z_threshold` (`upward_only`: only
    increases count, as for a gradient norm); silent until `min_history` values have been seen."""

    def __init__(self, *, window: int, min_history: int, z_threshold: float, upward_only: bool = False) -> None:
        self.history: deque[float] = deque(maxlen=window)
        self.min_history, self.z_threshold, self.upward_only = min_history, z_threshold, upward_only

    def update(self, value: float) -> float | None:
        """The z-score when `value` is a spike, else None (non-finite values are the NaN alert's, not ours)."""
        if not math.isfinite(value):
            return None
        z = robust_z(value, list(self.history)) if len(self.history) >= self.min_history else 0.0
        self.history.append(value)
        return z if (z if self.upward_only else abs(z)) > self.z_threshold else None


class DropDetector(_Windowed):
    """A value below `ratio` x the median of the last `window` values (throughput, response length)."""

    def __init__(self, *, window: int, min_history: int, ratio: float) -> None:
        self.history: deque[float] = deque(maxlen=window)
        self.min_history, self.ratio = min_history, ratio

    def update(self, value: float) -> float | None:
        """The window median when `value` dropped below ratio x it, else None."""
        if not math.isfinite(value):
            return None
        median = statistics.median(self.history) if len(self.history) >= self.min_history else 0.0
        self.history.append(value)
        return median if median > 0 and value < self.ratio * median else None


class FlatDetector(_Windowed):
    """Fires once when the last `steps` values all lie within `tolerance` of each other; re-arms on change."""

    def __init__(self, *, steps: int, tolerance: float) -> None:
        self.history: deque[float] = deque(maxlen=steps)
        self.steps, self.tolerance = steps, tolerance
        self._fired = False

    def update(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        self.history.append(value)
        flat = len(self.history) == self.steps and max(self.history) - min(self.history) <= self.tolerance
        fire = flat and not self._fired
        self._fired = flat
        return fire

    def state_dict(self) -> dict:
        return {"history": list(self.history), "fired": self._fired}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._fired = bool(state["fired"])

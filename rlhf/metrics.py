"""Step metrics: each value declares its cross-rank reduction; rank 0 writes console, TensorBoard and JSONL.

Names follow verl (`timing_s/gen`, `actor/pg_loss`, `response_length/mean`, ...). Roles live on different
ranks, so a metric is reduced over the ranks that *report* it: a role's DP contributors report shard sums
(`sum`), every rank reports its phase times (`max`), and values already global are reported by rank 0 only.
The whole step is reduced with one `all_gather_object`, so ranks with different metric sets cannot hang it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

Reduce = Literal["mean", "sum", "max", "min"]
# Role metrics that are the same on every contributor (not shard sums).
_SHARED_SUFFIXES = ("grad_norm", "lr", "skipped_steps", "kl_coef")
# Objects with `enter(name)` / `exit(name, seconds)` told about every timer (`rlhf profile` installs them).
TIMER_OBSERVERS: list = []


class StepMetrics:
    """Metrics of one step on this rank; `reduced()` returns the world-wide values (collective)."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[float, Reduce]] = {}

    def add(self, name: str, value: float | torch.Tensor, reduce: Reduce = "mean") -> None:
        self._values[name] = (float(value), reduce)

    def update(self, values: dict[str, float | torch.Tensor], reduce: Reduce = "mean", prefix: str = "") -> None:
        for name, value in values.items():
            self.add(prefix + name, value, reduce)

    def add_global(self, name: str, value: float | torch.Tensor) -> None:
        """A value every rank computed identically: reported once (by rank 0)."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            self.add(name, value, "max")

    def update_from_shards(self, values: dict[str, float]) -> None:
        """A role's per-contributor results: loss shares are summed, shared values (lr, grad norm) kept."""
        for name, value in values.items():
            self.add(name, value, "max" if name.endswith(_SHARED_SUFFIXES) else "sum")

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Wall time of the block as `timing_s/<name>` (max over ranks: the slowest rank sets the pace); summed
        over repeats within a step (dynamic sampling's generation rounds)."""
        for observer in TIMER_OBSERVERS:
            observer.enter(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            previous = self._values.get(f"timing_s/{name}", (0.0, "max"))[0]  # a phase run twice adds up
            self.add(f"timing_s/{name}", previous + seconds, "max")
            for observer in reversed(TIMER_OBSERVERS):
                observer.exit(name, seconds)

    def local(self) -> dict[str, float]:
        return {name: value for name, (value, _) in self._values.items()}

    def reduced(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Reduce over the ranks that reported each metric (collective over `group`)."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return self.local()
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, self._values, group=group)
        merged: dict[str, list[float]] = {}
        kinds: dict[str, Reduce] = {}
        for values in everyone:
            for name, (value, reduce) in values.items():
                merged.setdefault(name, []).append(value)
                if kinds.setdefault(name, reduce) != reduce:
                    raise RuntimeError(f"metric {name!r} is reduced as {kinds[name]} on one rank, {reduce} on another")
        ops = {"mean": lambda v: sum(v) / len(v), "sum": sum, "max": max, "min": min}
        return {name: ops[kinds[name]](values) for name, values in sorted(merged.items())}


class MetricsSink:
    """Rank 0 writes `metrics.jsonl` (one object per step) and TensorBoard events under the run folder."""

    def __init__(self, run_path: Path, enabled: bool, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self._jsonl = open(run_path / "metrics.jsonl", "a") if enabled else None
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_path / "tensorboard"))

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in sorted(values.items())}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

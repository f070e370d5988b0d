"""Step metrics: each value declares its cross-rank reduction; rank 0 writes console, TensorBoard and JSONL.

Names follow verl (`timing_s/gen`, `actor/pg_loss`, `response_length/mean`, ...). Reduction packs every metric
of one kind into a single tensor per op (one collective per op, not one per metric) and, with `verify`, checks
that every rank reports the same metric names — a rank with an extra metric would otherwise hang the step.
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

from rlhf.dist import collectives

Reduce = Literal["mean", "sum", "max", "min"]


class StepMetrics:
    """Metrics of one step on this rank; `reduced()` returns the world-wide values (collective)."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[float, Reduce]] = {}

    def add(self, name: str, value: float | torch.Tensor, reduce: Reduce = "mean") -> None:
        self._values[name] = (float(value), reduce)

    def update(self, values: dict[str, float | torch.Tensor], reduce: Reduce = "mean", prefix: str = "") -> None:
        for name, value in values.items():
            self.add(prefix + name, value, reduce)

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Wall time of the block as `timing_s/<name>` (max over ranks: the slowest rank sets the pace)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(f"timing_s/{name}", time.perf_counter() - start, "max")

    def local(self) -> dict[str, float]:
        return {name: value for name, (value, _) in self._values.items()}

    def reduced(self, group: dist.ProcessGroup | None = None, verify: bool = True) -> dict[str, float]:
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return self.local()
        by_op: dict[str, dict[str, torch.Tensor]] = {"sum": {}, "max": {}, "min": {}}
        for name, (value, reduce) in sorted(self._values.items()):
            op = "sum" if reduce == "mean" else reduce
            by_op[op][name] = torch.tensor(value, dtype=torch.float64)
        for op, tensors in by_op.items():
            collectives.all_reduce(tensors, op=op, group=group, verify=verify, name=f"metrics_{op}")
        world = dist.get_world_size(group)
        out = {}
        for name, (_, reduce) in self._values.items():
            total = by_op["sum" if reduce == "mean" else reduce][name].item()
            out[name] = total / world if reduce == "mean" else total
        return out


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

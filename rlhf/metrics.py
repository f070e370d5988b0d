"""Step metrics: each value declares its cross-rank reduction; rank 0 writes console, TensorBoard and JSONL.

Names follow verl (`timing_s/gen`, `actor/pg_loss`, `response_length/mean`, ...). Roles live on different
ranks, so a metric is reduced over the ranks that *report* it: a role's DP contributors report shard sums
(`sum`), every rank reports its phase times (`max`), and values already global are reported by rank 0 only.
A step is reduced by `MetricReducer` with two bucketed all-reduces (sum, max) over a metric layout all ranks
agreed on; a rank reporting a metric the layout lacks makes every rank re-agree (names exchanged as text,
never pickled), so ranks with different metric sets cannot hang it.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from rlhf.loggers import RunInfo, build_loggers
from rlhf.run_dir import quiet_console

Reduce = Literal["mean", "sum", "max", "min"]
# Role metrics that are the same on every contributor (not shard sums).
_SHARED_SUFFIXES = ("grad_norm", "lr", "skipped_steps", "kl_coef")
_SHARED_PARTS = ("/moe/",)  # a role's routing metrics, reduced over the role by the role itself
# Objects with `enter(name)` / `exit(name, seconds)` told about every timer (`rlhf profile` installs them).
TIMER_OBSERVERS: list = []


class StepMetrics:
    """Metrics of one step on this rank; `reduced()` returns the world-wide values (collective). Global values
    are reported by `reporter_rank` (a rank that holds the step's batch: async rollout ranks do not)."""

    def __init__(self, reporter_rank: int = 0) -> None:
        self._values: dict[str, tuple[float, Reduce]] = {}
        self.reporter_rank = reporter_rank

    def add(self, name: str, value: float | torch.Tensor, reduce: Reduce = "mean") -> None:
        self._values[name] = (float(value), reduce)

    def update(self, values: dict[str, float | torch.Tensor], reduce: Reduce = "mean", prefix: str = "") -> None:
        for name, value in values.items():
            self.add(prefix + name, value, reduce)

    def add_global(self, name: str, value: float | torch.Tensor) -> None:
        """A value every rank computed identically: reported once (by the reporter rank, default 0)."""
        if not dist.is_initialized() or dist.get_rank() == self.reporter_rank:
            self.add(name, value, "max")

    def update_from_shards(self, values: dict[str, float]) -> None:
        """A role's per-contributor results: loss shares are summed, shared values (lr, grad norm) kept."""
        for name, value in values.items():
            shared = name.endswith(_SHARED_SUFFIXES) or any(part in name for part in _SHARED_PARTS)
            self.add(name, value, "max" if shared else "sum")

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

    def entries(self) -> dict[str, tuple[float, Reduce]]:
        return dict(self._values)

    def reduced(self, reducer: MetricReducer | None = None) -> dict[str, float]:
        """Reduce over the ranks that reported each metric (collective over the reducer's group)."""
        return (reducer or MetricReducer()).reduce(self)


class MetricReducer:
    """Reduces each step's `StepMetrics` with two bucketed all-reduces over a layout kept across steps.

    Per metric: (sum, count) in a float64 SUM buffer, (max, -min) in a MAX buffer; slot 0 of the SUM buffer
    counts ranks whose metrics the layout lacks (then all ranks re-agree and reduce again), and the MAX buffer
    ends with the layout's hash and its negation, so diverged layouts fail loudly instead of mixing values.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, strategy: str = "bucket",
                 min_bucket_mb: float = 1.0, verify: bool = False, timeout_s: float | None = None) -> None:
        self.group, self.verify, self.timeout_s = group, verify, timeout_s
        self.strategy, self.min_bucket_mb = strategy, min_bucket_mb
        self.layout: tuple[tuple[str, str], ...] = ()
        self.num_relayouts = 0

    def reduce(self, metrics: StepMetrics) -> dict[str, float]:
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return metrics.local()
        entries = metrics.entries()
        result = self._reduce_once(entries)
        if result is None:
            self._relayout(entries)
            result = self._reduce_once(entries)
            assert result is not None, "every rank's metrics are in the agreed layout"
        return result

    def _collective(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        from rlhf.parallel.collectives import all_reduce

        all_reduce([tensor], op=op, group=self.group, strategy=self.strategy, min_bucket_mb=self.min_bucket_mb,
                   verify=self.verify, timeout_s=self.timeout_s, name=name)
        return tensor

    def _reduce_once(self, entries: dict[str, tuple[float, Reduce]]) -> dict[str, float] | None:
        index = {key: i for i, key in enumerate(self.layout)}
        keys = {(name, reduce) for name, (_, reduce) in entries.items()}
        sums = [0.0] * (1 + 2 * len(self.layout))
        sums[0] = float(not keys <= index.keys())
        extremes = [-math.inf] * (2 * len(self.layout) + 2)
        for name, (value, reduce) in entries.items():
            i = index.get((name, reduce))
            if i is not None:
                sums[1 + 2 * i], sums[2 + 2 * i] = value, 1.0
                extremes[2 * i], extremes[2 * i + 1] = value, -value
        summed = self._collective(torch.tensor(sums, dtype=torch.float64), "sum", "metrics: sum").tolist()
        if summed[0] > 0:
            return None
        digest = float(_layout_hash(self.layout))
        extremes[-2], extremes[-1] = digest, -digest
        maxed = self._collective(torch.tensor(extremes, dtype=torch.float64), "max", "metrics: max").tolist()
        if maxed[-2] != digest or maxed[-1] != -digest:
            raise RuntimeError("metric layouts differ across ranks (internal error: ranks agreed on different "
                               "metric names)")
        out = {}
        for i, (name, reduce) in enumerate(self.layout):
            total, count = summed[1 + 2 * i], summed[2 + 2 * i]
            if count == 0:
                continue
            if reduce == "mean":
                out[name] = total / count
            elif reduce == "sum":
                out[name] = total
            elif math.isnan(total):  # a MAX all-reduce may drop a NaN (gloo compares); the SUM slot keeps it
                out[name] = math.nan
            else:
                out[name] = maxed[2 * i] if reduce == "max" else -maxed[2 * i + 1]
        return dict(sorted(out.items()))

    def _relayout(self, entries: dict[str, tuple[float, Reduce]]) -> None:
        """Agree on the union of every rank's (name, reduce) pairs; names travel as UTF-8 text."""
        from rlhf.parallel.wire import all_gather_bytes

        mine = "\n".join(f"{reduce}\t{name}" for name, (_, reduce) in sorted(entries.items()))
        keys = set(self.layout)
        for payload in all_gather_bytes(mine.encode(), group=self.group):
            keys |= {tuple(reversed(line.split("\t", 1))) for line in payload.decode().splitlines()}
        kinds: dict[str, str] = {}
        for name, reduce in sorted(keys):
            if kinds.setdefault(name, reduce) != reduce:
                raise RuntimeError(f"metric {name!r} is reduced as {kinds[name]} on one rank, {reduce} on another")
        self.layout = tuple(sorted(keys))
        self.num_relayouts += 1


def _layout_hash(layout: tuple[tuple[str, str], ...]) -> int:
    """A 52-bit digest of the layout (exact in float64)."""
    digest = hashlib.sha256("\n".join(f"{r}\t{n}" for n, r in layout).encode()).digest()
    return int.from_bytes(digest[:7], "big") >> 4


class MetricsSink:
    """Rank 0 writes each step's metrics to the `trainer.logger` backends (`rlhf.loggers`): by default
    `metrics.jsonl` (one object per step) and TensorBoard events under the run folder.

    With `first_step` (a run starting or resuming there), rows of an earlier attempt at or after it are dropped
    from the jsonl files (atomically) and TensorBoard purges its events from that step on, so no step repeats.
    """

    def __init__(self, run_path: Path, enabled: bool, tensorboard: bool = True, first_step: int | None = None,
                 loggers: list[str] | None = None, info: RunInfo | None = None) -> None:
        self.enabled = enabled
        names = loggers if loggers is not None else ["jsonl"] + (["tensorboard"] if tensorboard else [])
        self._backends = build_loggers(names, run_path, first_step, info) if enabled else []
        if enabled and "console" not in names and loggers is not None:
            quiet_console()

    def write(self, step: int, values: dict[str, float]) -> None:
        for backend in self._backends:
            backend.write(step, values)

    def write_samples(self, step: int, samples: list[dict]) -> None:
        """Validation generations as text (samples.jsonl, TensorBoard text, a wandb table, an mlflow artifact)."""
        if samples:
            for backend in self._backends:
                backend.write_samples(step, samples)

    def close(self) -> None:
        for backend in self._backends:
            backend.close()


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

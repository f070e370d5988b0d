"""When each phase ran, per rank, and how much of it overlapped the other side's work (async RL's point).

`PhaseTimeline` observes `StepMetrics.timer` and records every phase's interval in seconds from the start of
its step on this rank. Ranks start a step together (they leave the previous step's world-wide metric reduction
at the same moment, to within that collective's latency), so intervals compare across ranks and hosts without a
shared clock. `overlap_report` takes every rank's timeline and side: the rollout side's work is generation, the
training side's the scoring and update phases; a phase's overlap is the part of it during which some rank of the
other side was working. On colocated placement every rank is on both sides and nothing can overlap.
"""

from __future__ import annotations

import statistics
import time

ROLLOUT_WORK = ("gen",)
TRAIN_WORK = ("reward", "old_log_prob", "ref", "values", "adv", "update_actor", "update_critic")

Interval = tuple[float, float]


class PhaseTimeline:
    """Per timed step, this rank's phases as [name, start, end] (seconds from the step's start)."""

    def __init__(self) -> None:
        self.steps: list[list[list]] = []
        self._open: list[tuple[str, float]] = []
        self._step_start = 0.0

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        if name == "step":
            self._step_start = now
            self.steps.append([])
        self._open.append((name, now))

    def exit(self, name: str, seconds: float) -> None:
        opened, start = self._open.pop()
        assert opened == name, (opened, name)
        if any(outer == "step" for outer, _ in self._open):  # phases outside a step are not the step's
            self.steps[-1].append([name, start - self._step_start, time.perf_counter() - self._step_start])


def side_of(is_rollout: bool, is_training: bool) -> str:
    """"rollout", "train" or "both" (colocated: one rank generates and trains)."""
    if is_rollout and is_training:
        return "both"
    return "rollout" if is_rollout else "train"


def union(intervals: list[Interval]) -> list[Interval]:
    """Disjoint sorted intervals covering the same time."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def covered(interval: Interval, disjoint: list[Interval]) -> float:
    """Seconds of `interval` inside the disjoint intervals."""
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in disjoint)


def overlap_report(timelines: list[list[list[list]]], sides: list[str]) -> dict | None:
    """Median over steps of each (side, phase): seconds (longest rank) and seconds overlapped by the other side's
    work; plus the share of the step both sides were busy. None when no rank is on one side only."""
    if "rollout" not in sides or "train" not in sides:
        return None
    work = {"rollout": ROLLOUT_WORK, "train": TRAIN_WORK}
    other = {"rollout": "train", "train": "rollout"}
    per_step: list[dict[tuple[str, str], tuple[float, float]]] = []
    both_busy: list[float] = []
    for step in range(min(len(t) for t in timelines)):
        busy = {side: union([(s, e) for rank, timeline in enumerate(timelines) if sides[rank] == side
                             for name, s, e in timeline[step] if name in work[side]]) for side in work}
        rows: dict[tuple[str, str], tuple[float, float]] = {}
        for rank, timeline in enumerate(timelines):
            side = sides[rank]
            if side == "both":
                continue
            for name, start, end in timeline[step]:
                seconds, overlapped = rows.get((side, name), (0.0, 0.0))
                span = (start, end)
                rows[(side, name)] = (max(seconds, end - start), max(overlapped, covered(span, busy[other[side]])))
        per_step.append(rows)
        both_busy.append(sum(covered(span, busy["train"]) for span in busy["rollout"]))
    keys = sorted({key for rows in per_step for key in rows}, key=lambda k: (k[0] != "rollout", k[1]))
    phases = [{"side": side, "phase": name,
               "seconds": statistics.median(rows.get((side, name), (0.0, 0.0))[0] for rows in per_step),
               "overlapped_s": statistics.median(rows.get((side, name), (0.0, 0.0))[1] for rows in per_step)}
              for side, name in keys]
    return {"phases": phases, "both_busy_s": statistics.median(both_busy)}

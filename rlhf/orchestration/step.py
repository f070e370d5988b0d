"""One RL step (DESIGN.md §2): two typed halves and the boundary between them, ordered by a driver.

  RolloutSide   generate(k) ──► RolloutShare            prompts ─► engine ─► rule reward ─► RolloutBatch rows
                                                        (DAPO rounds, partial rollouts: `rollout_side.py`)
  Boundary      exchange(share) ──► RolloutBatch        the global batch on every rank (`boundary.py`)
  TrainSide     train(RolloutBatch) ──► ScoredBatch     reward model, old/ref logprobs, values, advantages,
                                                        correction weights, loss mask, actor / critic update
  on_scored     (ScoredBatch, k)                        rollout dumps, the NaN-abort dump, tests
  Boundary      sync() · reduce(metrics)                weight push, policy version + 1; world metrics

  sync:   exchange(generate(k)) ──► train ──► sync
  async:  rollout ranks generate(k+s) while the training ranks train batch k (in flight) ──► exchange ──► sync
  replay: train(load(k)) ──► sync

Each driver below is only that ordering; the work and its metrics (verl names) live in the sides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlhf.metrics import StepMetrics
from rlhf.orchestration.async_schedule import AsyncSchedule
from rlhf.orchestration.boundary import Boundary
from rlhf.orchestration.rollout_side import RolloutSide
from rlhf.orchestration.train_side import TrainSide
from rlhf.stages.batch import RolloutBatch, ScoredBatch


@dataclass(kw_only=True, eq=False)
class StepDriver:
    """This rank's step: the sides, the boundary, the async pipeline (None: synchronous) and the hook that sees
    every scored batch, under the step that trained it."""

    rollout: RolloutSide
    train: TrainSide
    boundary: Boundary
    pipeline: AsyncSchedule | None
    on_scored: Callable[[ScoredBatch, int], None]

    def run(self, step: int) -> StepMetrics:
        """Step `step` on this rank (unreduced metrics), synchronous or one-step-off."""
        return self.one_step_off(step) if self.pipeline is not None else self.sync(step)

    def sync(self, step: int) -> StepMetrics:
        metrics = StepMetrics()
        with metrics.timer("step"):
            batch = self.boundary.exchange(self.rollout.generate(step, metrics), metrics)
            scored = self._train(batch, step, metrics)
            self.boundary.sync(metrics)
        return self._report(metrics, scored, step)

    def one_step_off(self, step: int) -> StepMetrics:
        pipeline = self.pipeline
        metrics = StepMetrics(reporter_rank=pipeline.reporter_rank)
        with metrics.timer("step"):
            while pipeline.filling(step):
                pipeline.push(self.boundary.exchange(self.rollout.generate(pipeline.next_index, metrics), metrics))
            share = self.rollout.generate(pipeline.next_index, metrics)  # rollout ranks only
            self.rollout.start(pipeline.next_index + 1, metrics)  # partial rollouts
            batch = pipeline.pop(step)  # training ranks only
            scored = self._train(batch, step, metrics) if batch is not None else None
            pipeline.push(self.boundary.exchange(share, metrics))
            self.boundary.sync(metrics)
        return self._report(metrics, scored, step)

    def replay(self, step: int, load: Callable[[], RolloutBatch]) -> StepMetrics:
        """`rlhf replay`: the step's batch read back from a rollout dump instead of generated."""
        metrics = StepMetrics()
        with metrics.timer("step"):
            with metrics.timer("load"):
                batch = load()
            scored = self._train(batch, step, metrics)
            self.boundary.sync(metrics)
        return self._report(metrics, scored, step)

    def _train(self, batch: RolloutBatch, step: int, metrics: StepMetrics) -> ScoredBatch:
        scored = self.train.train(batch, metrics, step)
        with metrics.timer("on_scored"):
            self.on_scored(scored, step)
        return scored

    def _report(self, metrics: StepMetrics, scored: ScoredBatch | None, step: int) -> StepMetrics:
        """The trained batch's metrics (after the step's timer: throughput reads it) and dynamic sampling's."""
        if scored is not None:
            self.train.report(metrics, scored, actor_version=step - 1)
        self.rollout.report(metrics)
        return metrics

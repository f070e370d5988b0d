"""The boundary between the two sides of an RL step (DESIGN.md §2): every collective the whole world takes part in.

  exchange(share) : the rollout contributors' rows ──► the global RolloutBatch on every rank (tensor collectives)
  sync()          : actor weights ──► rollout engine (shared tensors, or the planned, bucketed resharding)
  reduce(metrics) : this rank's step metrics ──► the world's (one bucketed all-reduce over a fixed layout)
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.metrics import MetricReducer, StepMetrics
from rlhf.orchestration.rollout_side import RolloutShare
from rlhf.orchestration.schema import RlhfConfig
from rlhf.parallel.layout import ParallelLayout
from rlhf.rollout.engine import RolloutEngine
from rlhf.stages.batch import RolloutBatch
from rlhf.stages.exchange import gather_global_batch
from rlhf.stages.memory import MemoryPhases
from rlhf.stages.sync import EngineSync, SharedWeights


@dataclass(kw_only=True, eq=False)
class Boundary:
    layout: ParallelLayout  # the rollout mesh's: whose contributors send
    engine: RolloutEngine | None  # this rank's rollout engine (None off the rollout mesh)
    weight_sync: EngineSync
    memory: MemoryPhases
    reducer: MetricReducer
    pushed: bool = False  # the actor's weights reached an engine with its own copy (`first_sync`)

    @classmethod
    def from_config(cls, cfg: RlhfConfig, layout: ParallelLayout, *, engine: RolloutEngine | None,
                    weight_sync: EngineSync, memory: MemoryPhases) -> Boundary:
        comm = cfg.comm
        reducer = MetricReducer(strategy=comm.strategy, min_bucket_mb=comm.min_bucket_mb, verify=comm.verify,
                                timeout_s=cfg.dist.timeout_s)
        return cls(layout=layout, engine=engine, weight_sync=weight_sync, memory=memory, reducer=reducer)

    def exchange(self, share: RolloutShare, metrics: StepMetrics) -> RolloutBatch:
        """Collective over the world: each rollout replica's contributor sends its rows; every rank gets the
        batch (dp order)."""
        with metrics.timer("gather"):
            return gather_global_batch(share.batch, share.num_prompts, self.layout)

    def sync(self, metrics: StepMetrics) -> None:
        """Collective: the rollout engine takes the actor's updated weights; the policy version + 1."""
        with self.memory.weight_sync(metrics), metrics.timer("update_weights"):
            stats = self.weight_sync.sync()
        report = getattr(self.weight_sync, "reported", None)  # what this sync says about itself (bytes)
        if report is not None:
            metrics.update(report(stats), "sum")

    def first_sync(self) -> None:
        """An engine with its own weights (a resharded copy, or vLLM's dummy init) takes the actor's current (maybe
        resumed) ones before the first rollout; the policy version stays what the checkpoint (or 0) says.
        Collective; idempotent."""
        if self.pushed or isinstance(self.weight_sync, SharedWeights):
            self.pushed = True
            return
        self.pushed = True
        version = self.engine.policy_version if self.engine is not None else 0
        self.weight_sync.sync()
        if self.engine is not None:
            self.engine.policy_version = version

    def reduce(self, metrics: StepMetrics) -> dict[str, float]:
        """Collective: the step's metrics reduced over the world (what rank 0 logs)."""
        return metrics.reduced(self.reducer)

"""Actor -> rollout engine weight sync, behind one interface so the resharding transport drops in.

`SharedWeights`: the native engine runs on the actor's own parameter tensors (colocated, same layout), so a
sync is free — the optimizer's in-place update *is* the sync. Every other case uses `rlhf.reshard.WeightSync`
(planned once, bucketed transfers, optional checksum verification).
"""

from __future__ import annotations

from typing import Protocol

from rlhf.rollout.engine import RolloutEngine


class EngineSync(Protocol):
    """What the step calls after the updates: `SharedWeights` here, or `rlhf.reshard.WeightSync`."""

    def sync(self) -> object:
        """Make the rollout engine generate with the actor's current weights; bump the policy version."""


class SharedWeights:
    def __init__(self, engine: RolloutEngine | None) -> None:
        self.engine = engine

    def sync(self) -> None:
        if self.engine is not None:
            self.engine.policy_version += 1

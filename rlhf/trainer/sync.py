"""Actor -> rollout engine weight sync, behind one interface so the resharding transport drops in.

`SharedWeights`: the native engine runs on the actor's own parameter tensors (colocated, same layout), so a
sync is free — the optimizer's in-place update *is* the sync. `CopySync`: the engine holds its own model in the
same layout; the actor's megatron-named shards are copied in (bucketed resharding replaces this for
differing layouts).
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlhf.rollout.engine import RolloutEngine


class WeightSync(Protocol):
    def sync(self) -> None:
        """Make the rollout engine generate with the actor's current weights; bump the policy version."""


class SharedWeights:
    def __init__(self, engine: RolloutEngine | None) -> None:
        self.engine = engine

    def sync(self) -> None:
        if self.engine is not None:
            self.engine.policy_version += 1


class CopySync:
    """Same layout, separate copies: stream the actor's local shards into the engine by megatron name."""

    def __init__(self, actor_model: torch.nn.Module | None, engine: RolloutEngine | None) -> None:
        self.actor_model, self.engine = actor_model, engine

    def sync(self) -> None:
        if self.engine is None:
            return
        self.engine.load_weights((name, param.detach()) for name, param in self.actor_model.named_parameters())

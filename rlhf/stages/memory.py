"""Colocated memory phases of one RL step: what the device holds while generating, training and syncing.

    rollout:  roles offload -> engine.wake() -> generate (+ rule scores) -> engine.sleep(release) -> roles reload
    train:    scoring forwards, advantages, updates        (training state resident, KV cache freed)
    sync:     engine.wake(kv_cache=False) -> weight sync   (KV cache stays freed until the next rollout)

Why this order: the sync pushes weights into the engine, so an engine that slept with its weights released
(`rollout.sleep=kv_cache_and_weights`, vLLM level 2) gets its weight memory back first (vLLM refuses a push
into sleeping weights); only weights — the KV cache returns at the next rollout, so it never coexists with
grads and optimizer state. Offloaded: roles that hold a model on this rank when this rank also generates
(split placement: no overlap, nothing to do). Each phase records `memory/<phase>/{allocated,peak}_gb`
(under `rlhf profile`, whose phase meter also resets the accelerator peak, a peak covers the phase's tail).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rlhf import platform
from rlhf.errors import ConfigError
from rlhf.metrics import StepMetrics
from rlhf.rollout.engine import RolloutEngine

if TYPE_CHECKING:
    from rlhf.parallel.meshes import RoleMesh

log = logging.getLogger(__name__)
GB = 1024**3
SLEEPS = ("none", "kv_cache", "kv_cache_and_weights")


class OffloadableRole(Protocol):
    """A model role (`stages.model_role.ModelRole`) as the phases see it."""

    name: str
    mesh: RoleMesh  # `.is_member`: whether this rank holds the role's model
    offloads: bool  # whether `offload` frees anything (optim.offload, ref.offload, reward.model_offload)

    def offload(self, *, keep_params: bool = False) -> None:
        """Free this role's device memory (keeping its parameters with `keep_params`), with a host copy."""

    def reload(self) -> None:
        """Bring back, bit-exact, what `offload` freed."""


@dataclass(frozen=True)
class ParkedRole:
    """A role offloaded during the rollout phase; `keep_params` when the rollout engine generates with them."""

    name: str
    role: OffloadableRole
    keep_params: bool = False


def check_sleep(sleep: str, weights_shared: bool) -> None:
    """Dropping the engine's weights is only possible when the engine owns its copy."""
    if sleep == "kv_cache_and_weights" and weights_shared:
        raise ConfigError("rollout.sleep=kv_cache_and_weights would free the weights the native engine shares "
                          "with the actor (same layout); use rollout.sleep=kv_cache, or give mesh.rollout "
                          "its own layout (e.g. another tp)")


class MemoryPhases:
    """The per-step memory sequence on this rank (see the module docstring); a no-op when nothing is set."""

    def __init__(self, engine: RolloutEngine | None = None, roles: Sequence[ParkedRole] = (), *,
                 sleep: str = "none") -> None:
        assert sleep in SLEEPS, sleep
        self.engine, self.roles = engine, list(roles)
        self.sleeps = sleep != "none" and engine is not None and getattr(engine, "can_sleep", True)
        if sleep != "none" and engine is not None and not self.sleeps:
            log.info("rollout.sleep=%s: the engine cannot sleep on this platform, so nothing is released "
                     "between rollouts", sleep)
        self.release_weights = sleep == "kv_cache_and_weights"

    @contextmanager
    def rollout(self, metrics: StepMetrics | None = None, *, sync_follows: bool = True) -> Iterator[None]:
        """Around generation: training state out, KV cache in, and back after. Weights are only dropped when a
        weight sync refills them before the next rollout (a training step, not validation: `sync_follows`)."""
        with _measured(metrics, "rollout"):
            with self._timer(metrics, "offload"):
                for parked in self.roles:
                    parked.role.offload(keep_params=parked.keep_params)
                if self.sleeps:
                    self.engine.wake()
            yield
        with self._timer(metrics, "reload"):
            if self.sleeps:
                self.engine.sleep(release_weights=self.release_weights and sync_follows)
            if metrics is not None:
                metrics.add("memory/asleep/allocated_gb", platform.allocated_memory_bytes() / GB, "max")
            for parked in self.roles:
                parked.role.reload()

    def training(self, metrics: StepMetrics | None = None) -> AbstractContextManager[None]:
        """Scoring forwards and updates: nothing moves, the phase's memory is recorded."""
        return _measured(metrics, "train")

    @contextmanager
    def weight_sync(self, metrics: StepMetrics | None = None) -> Iterator[None]:
        """Before the push: a sleeping engine gets its weight memory back (not its KV cache)."""
        with _measured(metrics, "sync"):
            if self.sleeps:
                self.engine.wake(kv_cache=False)
            yield

    def _timer(self, metrics: StepMetrics | None, name: str) -> AbstractContextManager[None]:
        active = self.sleeps or self.roles
        return metrics.timer(name) if metrics is not None and active else nullcontext()


@contextmanager
def _measured(metrics: StepMetrics | None, phase: str) -> Iterator[None]:
    """`memory/<phase>/allocated_gb` at the phase's end and `peak_gb` inside it (on CPU: the larger RSS of start
    and end, as no peak can be reset there); both max over ranks."""
    if metrics is None:
        yield
        return
    window = platform.PeakWindow()
    try:
        yield
    finally:
        peak = window.close()
    metrics.add(f"memory/{phase}/allocated_gb", platform.allocated_memory_bytes() / GB, "max")
    metrics.add(f"memory/{phase}/peak_gb", peak / GB, "max")


def plan_memory_phases(*, engine: RolloutEngine | None, roles: Mapping[str, OffloadableRole | None],
                       on_rollout_mesh: bool, sleep: str, weights_shared: bool) -> MemoryPhases:
    """This rank's phases: the roles (None: not configured) that offload and also live on the rollout mesh.

    With `weights_shared` (the native engine reads the actor's parameters) the actor keeps its parameters.
    """
    check_sleep(sleep, weights_shared)
    parked = [ParkedRole(name, role, keep_params=weights_shared and name == "actor")
              for name, role in roles.items()
              if role is not None and on_rollout_mesh and role.mesh.is_member and role.offloads]
    return MemoryPhases(engine, parked, sleep=sleep)

"""Config sections of the distributed runtime: process-group setup, collectives, and the role meshes (meshes.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlhf.errors import ConfigError
from rlhf.platform import BACKENDS


@dataclass(kw_only=True)
class DistConfig:
    """How ranks connect: backend (auto = nccl with CUDA, else gloo) and the process-group timeout."""

    backend: str = "auto"  # collective backend; auto: nccl with CUDA devices, else gloo
    timeout_s: float = 600.0  # process-group timeout (a collective that waits longer fails)
    seed: int = 1234  # torch/numpy/python RNG seed of every rank (model init, dropout)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"dist.backend={self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.timeout_s <= 0:
            raise ConfigError(f"dist.timeout_s={self.timeout_s} must be > 0 seconds")


@dataclass(kw_only=True)
class CommConfig:
    """Bucketed collectives and the hang watchdog (docs/design.md §5). `strategy` governs the metric reduction and
    the weight sync: `bucket` coalesces small tensors into flat buckets, `rs_ag` all-reduces as reduce-scatter
    + all-gather, `plain` sends every tensor on its own. The weight sync moves actor shards to the rollout mesh
    by `weight_sync_method` (auto: shared memory on one CPU host, p2p otherwise) in buckets of at most
    `weight_sync_bucket_mb` (0: 16 MB on CPU, 256 MB on accelerators)."""

    min_bucket_mb: float = 1.0  # smallest flat buffer small tensors are coalesced into for one collective
    # how buckets are reduced: one all_reduce, reduce_scatter + all_gather, or per tensor
    strategy: Literal["bucket", "rs_ag", "plain"] = "bucket"
    # how the weight sync moves actor shards to the rollout mesh: shared memory on one CPU host (auto), p2p, all_to_all
    weight_sync_method: Literal["auto", "shm", "p2p", "all_to_all"] = "auto"
    weight_sync_bucket_mb: float = 0.0  # largest weight-sync message; 0: 16 MB on CPU, 256 MB on accelerators
    verify: bool = False  # exchange a layout fingerprint before each bucketed collective (names mismatched ranks)
    step_timeout_s: float = 1800.0  # watchdog deadline of an RL step, the first weight push, first validation
    setup_timeout_s: float = 1800.0  # watchdog deadline of building the roles, resume, a save, an export

    def __post_init__(self) -> None:
        if self.min_bucket_mb <= 0:
            raise ConfigError(f"comm.min_bucket_mb={self.min_bucket_mb} must be > 0 (default 1.0)")
        if self.weight_sync_bucket_mb < 0:
            raise ConfigError(f"comm.weight_sync_bucket_mb={self.weight_sync_bucket_mb} must be >= 0 "
                              "(0: the platform default)")
        for name in ("step_timeout_s", "setup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"comm.{name}={getattr(self, name)} must be > 0 seconds")


ROLES = ("actor", "critic", "ref", "reward", "rollout", "teacher")


@dataclass(kw_only=True)
class RoleLayoutConfig:
    """One role's model parallelism; `ranks: [first, end)` is required for split placement only. `ep` splits a
    MoE model's experts over that many of the role's data-parallel ranks; at tp > 1 each expert is also split
    over tp (expert-tensor-parallel = tp)."""

    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size (rollout: 1)
    ep: int = 1  # expert-parallel size of a MoE model, within the role's cp x dp ranks
    cp: int = 1  # context-parallel size: each sequence split over this many ranks (training roles)
    ranks: list[int] | None = None  # split placement only: the role's ranks as [first, end)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.ranks is not None and (len(self.ranks) != 2 or not 0 <= self.ranks[0] < self.ranks[1]):
            raise ConfigError(f"ranks={self.ranks} must be [first, end) with 0 <= first < end, e.g. [0, 4]")


@dataclass(kw_only=True)
class MeshConfig:
    """Which roles exist, how they are placed, and each role's layout (dp is whatever ranks are left)."""

    # colocated: every role on every rank; split: roles on disjoint rank ranges
    placement: Literal["colocated", "split"] = "colocated"
    # roles that exist; null: those the run uses (actor and rollout always; critic for gae, ref for KL, reward for
    # reward.model_path, teacher for algo.distill); `rlhf train` refuses a list that names others
    roles: list[str] | None = None
    actor: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)
    critic: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)
    ref: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)
    reward: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)
    rollout: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)
    teacher: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)  # every distillation teacher's layout

    def __post_init__(self) -> None:
        if self.roles is not None:
            for role in self.roles:
                if role not in ROLES:
                    raise ConfigError(f"mesh.roles has unknown role {role!r}; roles are {', '.join(ROLES)}")
            if len(set(self.roles)) != len(self.roles):
                raise ConfigError(f"mesh.roles={self.roles} lists a role twice")
            if "actor" not in self.roles or "rollout" not in self.roles:
                raise ConfigError(f"mesh.roles={self.roles} must include 'actor' and 'rollout'")
        if self.rollout.pp != 1:
            raise ConfigError(f"mesh.rollout.pp={self.rollout.pp}: rollout engines run with pp=1; "
                              "use mesh.rollout.tp to shard the rollout model")
        if self.rollout.ep != 1:
            raise ConfigError(f"mesh.rollout.ep={self.rollout.ep}: rollout engines hold every expert (ep=1); "
                              "the weight sync gathers them from the training layout's expert-parallel ranks")


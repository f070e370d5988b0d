"""Config sections owned by the distributed runtime: process-group setup and collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf.errors import ConfigError
from rlhf.platform import BACKENDS


@dataclass(kw_only=True)
class DistConfig:
    """How ranks connect: backend (auto = nccl with CUDA, else gloo) and the process-group timeout."""

    backend: str = "auto"
    timeout_s: float = 600.0
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"dist.backend={self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.timeout_s <= 0:
            raise ConfigError(f"dist.timeout_s={self.timeout_s} must be > 0 seconds")


@dataclass(kw_only=True)
class CommConfig:
    """Bucketed collectives and the hang watchdog (DESIGN.md §7). `strategy` governs the metric reduction and
    the weight sync: `bucket` coalesces small tensors into flat buckets, `rs_ag` all-reduces as reduce-scatter
    + all-gather, `plain` sends every tensor on its own. The weight sync moves actor shards to the rollout mesh
    by `weight_sync_method` (auto: shared memory on one CPU host, p2p otherwise) in buckets of at most
    `weight_sync_bucket_mb` (0: 16 MB on CPU, 256 MB on accelerators)."""

    min_bucket_mb: float = 1.0
    strategy: Literal["bucket", "rs_ag", "plain"] = "bucket"
    weight_sync_method: Literal["auto", "shm", "p2p", "all_to_all"] = "auto"
    weight_sync_bucket_mb: float = 0.0
    verify: bool = False
    step_timeout_s: float = 1800.0  # an RL step, the first weight push, validation before training
    setup_timeout_s: float = 1800.0  # building the roles, resume, a checkpoint save, export

    def __post_init__(self) -> None:
        if self.min_bucket_mb <= 0:
            raise ConfigError(f"comm.min_bucket_mb={self.min_bucket_mb} must be > 0 (default 1.0)")
        if self.weight_sync_bucket_mb < 0:
            raise ConfigError(f"comm.weight_sync_bucket_mb={self.weight_sync_bucket_mb} must be >= 0 "
                              "(0: the platform default)")
        for name in ("step_timeout_s", "setup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"comm.{name}={getattr(self, name)} must be > 0 seconds")

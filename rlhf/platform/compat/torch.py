"""torch's private touch-points: c10d internals that have no public API yet, and oneDNN's packed-linear ops.

pinned: torch==2.13.0

Touch-points (name: what it does; why):
- `default_store`: `distributed_c10d._get_default_store()`, the rendezvous store of the default group; the
  watchdog's heartbeats and the Prometheus exporter read every rank's state from it without a collective.
- `abort_process_group`: `distributed_c10d._abort_process_group`, c10d's own abort (torch 2.13 has no public
  one); the watchdog unblocks NCCL peers' kernels with it before exiting.
- `init_fake_world`: importing `torch.testing._internal.distributed.fake_pg` registers the "fake" backend
  (collectives return at once), on which `rlhf plan` dry-runs 1000-rank layouts in one process.
- `default_group_swapped`: `distributed_c10d._get_default_group` / `_update_default_pg`; vLLM's
  external_launcher takes the default group for its world, so a rollout mesh apart from the training ranks is
  made the default group while vLLM runs (`rlhf.rollout.vllm_engine.rollout_world`).
- `group_count` / `set_group_count`: `distributed_c10d._world.group_count`, the per-process counter torch names
  new groups by; after vLLM created groups on the rollout ranks alone, every rank continues from the largest.
- `preload_compiler`: `import torch._dynamo` before any process group exists: imported lazily while a group is live
  (transformers' `AutoConfig` does), it keeps that group and its gloo threads alive past `destroy_process_group`,
  and their teardown at interpreter exit aborts the process now and then (SIGABRT after a finished export).
- `ONEDNN_REORDER_LINEAR_WEIGHT` / `ONEDNN_LINEAR_POINTWISE`: `torch.ops.mkldnn._reorder_linear_weight` and
  `_linear_pointwise` (inductor's CPU ops; None when this build lacks them): a weight packed once into oneDNN's
  blocked layout runs decode-sized GEMMs 1.3-1.7x faster, with residual add, SiLU and product fused
  (`rlhf.platform.linear`).
- `ONEDNN_BF16`: `torch.ops.mkldnn._is_mkldnn_bf16_supported()`, whether this CPU runs oneDNN's bf16 kernels
  natively (AVX512-BF16 / AMX, or AVX512BW emulation); elsewhere bf16 weights stay on the plain torch path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def preload_compiler() -> None:
    """torch's compiler imported while no process group exists (see the header)."""
    import torch._dynamo  # noqa: F401


def default_store() -> dist.Store:
    """The store the default process group rendezvoused on (shared by every rank of the world)."""
    return c10d._get_default_store()


def abort_process_group(group: dist.ProcessGroup | None = None) -> None:
    """Abort `group` (None: every group), unblocking peers stuck in its collectives."""
    c10d._abort_process_group(group)


def init_fake_world(world_size: int, rank: int) -> None:
    """Join a `world_size`-rank world as `rank` on torch's fake backend (collectives return at once)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)


@contextlib.contextmanager
def default_group_swapped(group: dist.ProcessGroup) -> Iterator[None]:
    """While open, `group` is torch's default process group (group-less calls and new groups use it)."""
    world = c10d._get_default_group()
    c10d._update_default_pg(group)
    try:
        yield
    finally:
        c10d._update_default_pg(world)


def group_count() -> int:
    """How many groups this process has created: torch names the next one by it."""
    return c10d._world.group_count


def set_group_count(count: int) -> None:
    c10d._world.group_count = count


def _onednn_op(name: str) -> Any:
    """oneDNN's op `name` in this torch build, or None."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, name)):
        return None
    return getattr(torch.ops.mkldnn, name)


ONEDNN_REORDER_LINEAR_WEIGHT = _onednn_op("_reorder_linear_weight")
ONEDNN_LINEAR_POINTWISE = _onednn_op("_linear_pointwise")
_BF16_CHECK = _onednn_op("_is_mkldnn_bf16_supported")
ONEDNN_BF16 = bool(_BF16_CHECK is not None and _BF16_CHECK())

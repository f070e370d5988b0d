"""The megatron-core process-wide state rlhf cannot avoid, set up in one place.

megatron-core 0.16.1 reads two process-wide objects that `ProcessGroupCollection` does not replace:
- the RNG tracker (`tensor_parallel.random._CUDA_RNG_STATE_TRACKER`) that attention dropout and weight
  init fork from. It is seeded here with the tp rank of the model being built, so roles colocated in one
  process share it: with dropout > 0 they must use the same tp layout;
- the global memory buffer (`parallel_state._GLOBAL_MEMORY_BUFFER`) the local attention takes its
  scratch tensor from; it holds no layout, so one per process serves every role.
- the default (world) process group, which `get_megatron_optimizer` all-gathers its param-group keys over:
  roles on disjoint ranks (split placement) or built one after another would pair up those gathers across
  roles and hang or mix. `default_group_as` points that call at the role's own group.
Everything else rlhf hands to megatron explicitly through `ProcessGroupCollection`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from rlhf.platform import megatron_compat


def seed_rng_tracker(seed: int, tp_rank: int) -> None:
    """(Re)seed megatron's process-wide RNG tracker without reading its parallel_state globals."""
    megatron_compat.apply()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0,
                                                    force_reset_rng=True)


def ensure_memory_buffer() -> None:
    """Create megatron's process-wide scratch buffer once (the local attention spec asks for it)."""
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


@contextlib.contextmanager
def default_group_as(group: dist.ProcessGroup) -> Iterator[None]:
    """While active, megatron's group-less `all_gather_object` / `get_world_size` calls use `group`.

    Only wrap a megatron call known to use the default group for role-local agreement (optimizer building).
    """
    gather, world_size = dist.all_gather_object, dist.get_world_size

    def role_gather(object_list, obj, group_arg=None, **kwargs):
        return gather(object_list, obj, group=group_arg or kwargs.pop("group", None) or group, **kwargs)

    def role_world_size(group_arg=None, **kwargs):
        return world_size(group_arg or kwargs.pop("group", None) or group)

    dist.all_gather_object, dist.get_world_size = role_gather, role_world_size
    try:
        yield
    finally:
        dist.all_gather_object, dist.get_world_size = gather, world_size

"""The megatron-core process-wide state rlhf cannot avoid, set up in one place.

megatron-core 0.16.1 reads two process-wide objects that `ProcessGroupCollection` does not replace:
- the RNG tracker (`tensor_parallel.random._CUDA_RNG_STATE_TRACKER`) that attention dropout and weight
  init fork from. It is seeded here with the tp rank of the model being built, so roles colocated in one
  process share it: with dropout > 0 they must use the same tp layout;
- the global memory buffer (`parallel_state._GLOBAL_MEMORY_BUFFER`) the local attention takes its
  scratch tensor from; it holds no layout, so one per process serves every role.
Everything else rlhf hands to megatron explicitly through `ProcessGroupCollection`.
"""

from __future__ import annotations

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

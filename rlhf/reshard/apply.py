"""Tensor-level pieces every transport shares: destination buffers, slice views, and a whole plan run in one
process (the reference executor used by the planner tests and for same-process copies).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlhf.reshard.planner import ReshardPlan, Transfer


def src_view(tensor: torch.Tensor, transfer: Transfer) -> torch.Tensor:
    return tensor.narrow(transfer.dim, transfer.src_start, transfer.length)


def dst_view(tensor: torch.Tensor, transfer: Transfer) -> torch.Tensor:
    return tensor.narrow(transfer.dim, transfer.dst_start, transfer.length)


def allocate_dst(plan: ReshardPlan, rank: int, *, dtype: torch.dtype, device: torch.device | str = "cpu"
                 ) -> dict[str, torch.Tensor]:
    """Empty destination shards for `rank` (stage-local names), with vocab padding rows already zero."""
    buffers = {}
    for shard in plan.shards_of(rank):
        buffer = torch.empty(shard.shape, dtype=dtype, device=device)
        if shard.padding_rows:
            buffer[shard.shape[0] - shard.padding_rows:].zero_()
        buffers[shard.name] = buffer
    return buffers


def run_in_process(plan: ReshardPlan, sources: Mapping[int, Mapping[str, torch.Tensor]], *,
                   dtype: torch.dtype | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Every destination rank's shards, built from every source rank's tensors held in this one process."""
    some_tensor = next(iter(next(iter(sources.values())).values()))
    out_dtype = dtype or some_tensor.dtype
    results = {rank: allocate_dst(plan, rank, dtype=out_dtype) for rank in plan.dst_layout.ranks}
    for transfer in plan.transfers:
        source = sources[transfer.src_rank][transfer.src_name]
        dst_view(results[transfer.dst_rank][transfer.dst_name], transfer).copy_(src_view(source, transfer))
    return results

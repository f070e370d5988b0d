"""Verify a sync: every slice the engine now holds is bit-for-bit the trainer's slice (cast like the wire).

Each source rank checksums the slices it sent, each destination rank checksums the same regions of the
engine's live weights (`checkpoint.verify.bits_checksum`); one all_reduce of the int64 sums (a row per transfer)
brings the source sums to the destinations. Vocab padding rows must be zeros.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from rlhf.checkpoint.verify import bits_checksum
from rlhf.errors import WeightSyncError
from rlhf.reshard.apply import dst_view, src_view
from rlhf.reshard.planner import ReshardPlan




def verify_sync(plan: ReshardPlan, sources: Mapping[str, torch.Tensor], engine_weights: Mapping[str, torch.Tensor],
                *, dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup | None = None) -> int:
    """Raise WeightSyncError naming the bad slices; return how many slices this rank checked.

    Collective over `group`: every rank of the plan calls it (ranks outside pass empty mappings).
    """
    rank = dist.get_rank()
    sums = torch.zeros(len(plan.transfers), 2, dtype=torch.int64, device=device)
    for index, transfer in enumerate(plan.transfers):
        if transfer.src_rank == rank:
            sums[index] = bits_checksum(src_view(sources[transfer.src_name], transfer).to(dtype))
    dist.all_reduce(sums, group=group)
    bad, checked = [], 0
    for index, transfer in enumerate(plan.transfers):
        if transfer.dst_rank != rank:
            continue
        checked += 1
        if not torch.equal(bits_checksum(dst_view(engine_weights[transfer.dst_name], transfer).to(dtype)).to(device),
                           sums[index]):
            bad.append(f"{transfer.dst_name}[dim {transfer.dim}: {transfer.dst_start}:"
                       f"{transfer.dst_start + transfer.length}] (from rank {transfer.src_rank})")
    for shard in plan.shards_of(rank):
        if shard.padding_rows and engine_weights[shard.name][shard.shape[0] - shard.padding_rows:].any():
            bad.append(f"{shard.name} padding rows are not zero")
    if bad:
        raise WeightSyncError(f"rank {rank}: {len(bad)} rollout weight slice(s) differ from the trainer's after "
                              f"sync: {'; '.join(bad[:5])}")
    return checked

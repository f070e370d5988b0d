"""Execute a schedule on this rank: local slices are copied in process, remote ones travel as flat buckets.

Two wire methods: `p2p` (batched isend/irecv, one message per communicating pair and round) and
`all_to_all` (one `all_to_all_single` per round over the whole group, zero-sized splits for silent pairs).
Casting to the destination dtype happens while packing, so fp32 masters travel as bf16 when asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.reshard.apply import dst_view, src_view
from rlhf.reshard.schedule import Bucket, Schedule


@dataclass
class TransportStats:
    """What one rank moved in one execution (remote traffic only; local copies are free of the wire)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    num_messages: int = 0  # p2p sends + receives this rank posted
    num_collectives: int = 0  # collective calls this rank took part in


def pack(bucket: Bucket, sources: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Write the bucket's source slices, cast to `out`'s dtype, one after another into the flat `out`."""
    offset = 0
    for transfer in bucket.transfers:
        out[offset:offset + transfer.numel].view(transfer.shape).copy_(src_view(sources[transfer.src_name],
                                                                                transfer))
        offset += transfer.numel


def unpack(bucket: Bucket, flat: torch.Tensor, dst: Mapping[str, torch.Tensor]) -> None:
    offset = 0
    for transfer in bucket.transfers:
        dst_view(dst[transfer.dst_name], transfer).copy_(flat[offset:offset + transfer.numel].view(transfer.shape))
        offset += transfer.numel


def _round_p2p(sends: list[Bucket], recvs: list[Bucket], sources: Mapping[str, torch.Tensor],
               dst: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
               group: dist.ProcessGroup | None) -> int:
    ops, inbox = [], []
    for bucket in recvs:
        flat = torch.empty(bucket.numel, dtype=dtype, device=device)
        ops.append(dist.P2POp(dist.irecv, flat, bucket.src_rank, group))
        inbox.append((bucket, flat))
    for bucket in sends:
        flat = torch.empty(bucket.numel, dtype=dtype, device=device)
        pack(bucket, sources, flat)
        ops.append(dist.P2POp(dist.isend, flat, bucket.dst_rank, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for bucket, flat in inbox:
        unpack(bucket, flat, dst)
    return len(ops)


def _round_all_to_all(sends: list[Bucket], recvs: list[Bucket], sources: Mapping[str, torch.Tensor],
                      dst: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                      group_ranks: list[int], group: dist.ProcessGroup | None) -> None:
    send_of = {b.dst_rank: b for b in sends}
    recv_of = {b.src_rank: b for b in recvs}
    send_sizes = [send_of[r].numel if r in send_of else 0 for r in group_ranks]
    recv_sizes = [recv_of[r].numel if r in recv_of else 0 for r in group_ranks]
    flat_in = torch.empty(sum(send_sizes), dtype=dtype, device=device)
    flat_out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    for piece, rank in zip(flat_in.split(send_sizes), group_ranks):
        if rank in send_of:
            pack(send_of[rank], sources, piece)
    dist.all_to_all_single(flat_out, flat_in, recv_sizes, send_sizes, group=group)
    for piece, rank in zip(flat_out.split(recv_sizes), group_ranks):
        if rank in recv_of:
            unpack(recv_of[rank], piece, dst)


def execute(schedule: Schedule, sources: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor], *,
            dtype: torch.dtype, device: torch.device, method: str = "p2p",
            group: dist.ProcessGroup | None = None) -> TransportStats:
    """Fill this rank's destination shards `dst` from `sources` (this rank's training shards, by local name).

    Collective over `group` (default: the world): every rank of the plan must call it, with the same schedule.
    """
    rank = dist.get_rank()
    group_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    stats = TransportStats()
    itemsize = torch.empty((), dtype=dtype).element_size()
    for transfer in schedule.local_of(rank):
        dst_view(dst[transfer.dst_name], transfer).copy_(src_view(sources[transfer.src_name], transfer))
    for index in range(len(schedule.rounds)):
        sends, recvs = schedule.sends(rank, index), schedule.recvs(rank, index)
        stats.bytes_sent += sum(b.numel for b in sends) * itemsize
        stats.bytes_received += sum(b.numel for b in recvs) * itemsize
        if method == "p2p":
            stats.num_messages += _round_p2p(sends, recvs, sources, dst, dtype, device, group)
        else:
            _round_all_to_all(sends, recvs, sources, dst, dtype, device, group_ranks, group)
            stats.num_collectives += 1
    return stats

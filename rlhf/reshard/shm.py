"""Same-host CPU transport: each bucket is a shared-memory segment its source packs and its destination unpacks.

Loopback TCP (gloo) copies every byte through the kernel twice; a mapped segment costs one pack and one unpack.
Segments are created and mapped once per plan, then unlinked at once (the mappings stay valid and nothing is
left in /dev/shm if a rank dies). Per round: barrier, pack, barrier, unpack.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping

import torch
import torch.distributed as dist

from rlhf.reshard.apply import dst_view, src_view
from rlhf.reshard.schedule import Bucket, Schedule
from rlhf.reshard.transport import TransportStats, pack, unpack

SHM_DIR = "/dev/shm"


def all_on_one_host(group: dist.ProcessGroup | None) -> bool:
    """True when every rank of `group` runs on this host (collective)."""
    size = dist.get_world_size(group)
    hosts: list = [None] * size
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def _agreed_prefix(group: dist.ProcessGroup | None) -> str:
    token = [uuid.uuid4().hex]
    first = dist.get_process_group_ranks(group)[0] if group is not None else 0
    dist.broadcast_object_list(token, src=first, group=group)
    return os.path.join(SHM_DIR, f"rlhf-reshard-{token[0]}")


class SharedMemoryTransport:
    """Executes one schedule repeatedly through /dev/shm segments; build it on every rank of `group` together."""

    def __init__(self, schedule: Schedule, *, dtype: torch.dtype, group: dist.ProcessGroup | None = None) -> None:
        self.schedule, self.dtype, self.group = schedule, dtype, group
        self.rank = dist.get_rank()
        prefix = _agreed_prefix(group)
        self.segments: dict[tuple[int, int, int], torch.Tensor] = {}
        created = []
        for index, bucket in self._buckets(lambda b: b.src_rank == self.rank):
            path = f"{prefix}-{index}-{bucket.src_rank}-{bucket.dst_rank}"
            self.segments[(index, bucket.src_rank, bucket.dst_rank)] = self._map(path, bucket)
            created.append(path)
        dist.barrier(group=group)
        for index, bucket in self._buckets(lambda b: b.dst_rank == self.rank):
            path = f"{prefix}-{index}-{bucket.src_rank}-{bucket.dst_rank}"
            self.segments[(index, bucket.src_rank, bucket.dst_rank)] = self._map(path, bucket)
        dist.barrier(group=group)
        for path in created:
            os.unlink(path)

    def _buckets(self, keep) -> list[tuple[int, Bucket]]:
        return [(index, b) for index, buckets in enumerate(self.schedule.rounds) for b in buckets if keep(b)]

    def _map(self, path: str, bucket: Bucket) -> torch.Tensor:
        return torch.from_file(path, shared=True, size=bucket.numel, dtype=self.dtype)

    def execute(self, sources: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> TransportStats:
        """Fill this rank's destination shards; collective over the group (2 barriers per round)."""
        stats = TransportStats()
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        for transfer in self.schedule.local_of(self.rank):
            dst_view(dst[transfer.dst_name], transfer).copy_(src_view(sources[transfer.src_name], transfer))
        for index in range(len(self.schedule.rounds)):
            dist.barrier(group=self.group)  # the previous readers of these segments are done
            for bucket in self.schedule.sends(self.rank, index):
                pack(bucket, sources, self.segments[(index, bucket.src_rank, bucket.dst_rank)])
                stats.bytes_sent += bucket.numel * itemsize
            dist.barrier(group=self.group)
            for bucket in self.schedule.recvs(self.rank, index):
                unpack(bucket, self.segments[(index, bucket.src_rank, bucket.dst_rank)], dst)
                stats.bytes_received += bucket.numel * itemsize
            stats.num_collectives += 2
        return stats

"""Same-host CPU transport: each bucket is a shared-memory segment its source packs and its destination unpacks.

Loopback TCP (gloo) copies every byte through the kernel twice; a mapped segment costs one pack and one unpack.
Segments are created and mapped once per plan, then unlinked as soon as every rank has mapped them (the mappings
stay valid). A set-up that fails on any rank unlinks the whole plan's segments on every surviving rank; what a
killed world still leaves is named `rlhf-reshard-<job>-p<owner pid>-...`, so the next set-up (and `rlhf doctor
--clean-shm`) removes segments whose owner process is gone. Per round: barrier, pack, barrier, unpack.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.parallel.wire import all_gather_json
from rlhf.reshard.apply import dst_view, src_view
from rlhf.reshard.schedule import Bucket, Schedule
from rlhf.reshard.transport import TransportStats, pack, unpack
from rlhf.run_dir import get_logger

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "rlhf-reshard-"
_SEGMENT_NAME = re.compile(rf"^{SEGMENT_PREFIX}(?P<job>[A-Za-z0-9_.]+)-p(?P<pid>\d+)-")
log = get_logger("reshard")


def all_on_one_host(group: dist.ProcessGroup | None) -> bool:
    """True when every rank of `group` runs on this host (collective)."""
    return len(set(all_gather_json(socket.gethostname(), group=group))) == 1


def job_id() -> str:
    """The launcher's job id (Slurm, torchrun) made safe for a file name; `local` without one."""
    raw = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    return re.sub(r"[^A-Za-z0-9_.]", "_", raw)


def _owner_prefixes(group: dist.ProcessGroup | None) -> dict[int, str]:
    """Every rank's segment-name prefix (job, its pid, a token shared by the group), by global rank (collective)."""
    gathered = all_gather_json([os.getpid(), uuid.uuid4().hex[:12]], group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(gathered)))
    token, job = gathered[0][1], job_id()
    return {rank: f"{SEGMENT_PREFIX}{job}-p{pid}-{token}" for rank, (pid, _) in zip(ranks, gathered)}


@dataclass(frozen=True)
class Segment:
    """A segment file in the shm folder and whether the process that created it still runs."""

    path: str
    owner_pid: int
    job: str
    size_bytes: int
    owner_alive: bool


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def list_segments(shm_dir: str = SHM_DIR) -> list[Segment]:
    """rlhf's segments in `shm_dir` (assumes one pid namespace per shm folder, as in one container or host)."""
    found = []
    for entry in sorted(os.scandir(shm_dir), key=lambda e: e.name) if os.path.isdir(shm_dir) else []:
        match = _SEGMENT_NAME.match(entry.name)
        if match is None:
            continue
        try:
            size = entry.stat().st_size
        except FileNotFoundError:
            continue  # unlinked meanwhile by its owner
        pid = int(match["pid"])
        found.append(Segment(entry.path, pid, match["job"], size, _pid_alive(pid)))
    return found


def remove_dead_segments(shm_dir: str = SHM_DIR) -> list[Segment]:
    """Unlink the segments whose owner process is gone; returns what was removed."""
    removed = []
    for segment in list_segments(shm_dir):
        if not segment.owner_alive and _unlink(segment.path):
            removed.append(segment)
    return removed


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


class SharedMemoryTransport:
    """Executes one schedule repeatedly through /dev/shm segments; build it on every rank of `group` together."""

    def __init__(self, schedule: Schedule, *, dtype: torch.dtype, group: dist.ProcessGroup | None = None) -> None:
        self.schedule, self.dtype, self.group = schedule, dtype, group
        self.rank = dist.get_rank()
        removed = remove_dead_segments()
        if removed:
            log.warning("removed %d shared-memory segment(s) of dead processes (%.1f MB) from %s", len(removed),
                        sum(s.size_bytes for s in removed) / 2**20, SHM_DIR)
        prefixes = _owner_prefixes(group)
        paths = {(index, b.src_rank, b.dst_rank): f"{SHM_DIR}/{prefixes[b.src_rank]}-{index}-{b.src_rank}-"
                                                  f"{b.dst_rank}" for index, b in self._buckets(lambda b: True)}
        self.segments: dict[tuple[int, int, int], torch.Tensor] = {}
        try:
            self._map_all(paths)
        except BaseException:
            for path in paths.values():  # a peer died or we failed: leave none of this plan's segments behind
                _unlink(path)
            raise

    def _map_all(self, paths: dict[tuple[int, int, int], str]) -> None:
        """Sources create their segments, destinations map them, then the sources unlink them (collective)."""
        created = []
        for index, bucket in self._buckets(lambda b: b.src_rank == self.rank):
            key = (index, bucket.src_rank, bucket.dst_rank)
            created.append(paths[key])
            self.segments[key] = self._map(paths[key], bucket)
        dist.barrier(group=self.group)
        for index, bucket in self._buckets(lambda b: b.dst_rank == self.rank):
            key = (index, bucket.src_rank, bucket.dst_rank)
            self.segments[key] = self._map(paths[key], bucket)
        dist.barrier(group=self.group)
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

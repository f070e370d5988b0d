"""A plan cut into messages: per (source, destination) pair, transfers packed into flat buckets of bounded size.

Pure and global (every rank derives the same schedule from the same plan), so all ranks agree on the number
of message rounds without talking. Round k carries bucket k of every pair that has one.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.reshard.planner import ReshardPlan, Transfer


@dataclass(frozen=True)
class Bucket:
    """Transfers of one (src, dst) pair sent as one flat message of `numel` elements."""

    src_rank: int
    dst_rank: int
    transfers: tuple[Transfer, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.transfers)


@dataclass(frozen=True)
class Schedule:
    """`rounds[k]` lists the buckets sent in round k; `local` are this plan's same-rank copies."""

    rounds: tuple[tuple[Bucket, ...], ...]
    local: tuple[Transfer, ...]

    def sends(self, rank: int, round_index: int) -> list[Bucket]:
        return [b for b in self.rounds[round_index] if b.src_rank == rank]

    def recvs(self, rank: int, round_index: int) -> list[Bucket]:
        return [b for b in self.rounds[round_index] if b.dst_rank == rank]

    def local_of(self, rank: int) -> list[Transfer]:
        return [t for t in self.local if t.dst_rank == rank]

    @property
    def num_messages(self) -> int:
        return sum(len(buckets) for buckets in self.rounds)


def _split(transfers: list[Transfer], max_numel: int) -> list[list[Transfer]]:
    """Consecutive runs of at most `max_numel` elements (a larger single transfer travels alone)."""
    runs: list[list[Transfer]] = [[]]
    size = 0
    for transfer in transfers:
        if runs[-1] and size + transfer.numel > max_numel:
            runs.append([])
            size = 0
        runs[-1].append(transfer)
        size += transfer.numel
    return runs


def build_schedule(plan: ReshardPlan, *, max_bucket_numel: int) -> Schedule:
    """Group the plan's remote transfers by (src, dst) pair, in plan order, into buckets and rounds."""
    by_pair: dict[tuple[int, int], list[Transfer]] = {}
    local = []
    for transfer in plan.transfers:
        if transfer.is_local:
            local.append(transfer)
        else:
            by_pair.setdefault((transfer.src_rank, transfer.dst_rank), []).append(transfer)
    rounds: list[list[Bucket]] = []
    for (src, dst), transfers in sorted(by_pair.items()):
        for index, run in enumerate(_split(transfers, max_bucket_numel)):
            if index == len(rounds):
                rounds.append([])
            rounds[index].append(Bucket(src_rank=src, dst_rank=dst, transfers=tuple(run)))
    return Schedule(rounds=tuple(tuple(r) for r in rounds), local=tuple(local))

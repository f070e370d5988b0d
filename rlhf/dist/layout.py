"""Pure rank <-> coordinate math for a TP x DP x PP layout (no torch.distributed).

Rank order follows Megatron: **tp fastest, then dp, then pp**. Within a mesh that starts at global rank
`first_rank`:

    rank = first_rank + tp_rank + tp * (dp_rank + dp * pp_rank)

so a TP group is a run of consecutive ranks (one node's NVLink domain) and pipeline stages are the
outermost blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from rlhf.errors import ConfigError


class Coords(NamedTuple):
    tp_rank: int
    dp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class ParallelLayout:
    """A tp x dp x pp layout of `tp * dp * pp` consecutive ranks starting at `first_rank`."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    first_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"layout {name}={value!r} must be a positive integer")
        if not isinstance(self.first_rank, int) or self.first_rank < 0:
            raise ConfigError(f"layout first_rank={self.first_rank!r} must be a non-negative integer")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, first_rank: int = 0,
                  what: str = "layout") -> "ParallelLayout":
        """The layout filling `world_size` ranks with the given tp and pp (dp is what is left)."""
        if world_size % (tp * pp) != 0:
            raise ConfigError(
                f"{what}: {world_size} ranks are not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                f"choose tp and pp whose product divides {world_size}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), first_rank=first_rank)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.world_size)

    def contains(self, rank: int) -> bool:
        return self.first_rank <= rank < self.first_rank + self.world_size

    def coords(self, rank: int) -> Coords:
        if not self.contains(rank):
            raise ValueError(f"rank {rank} is outside {self}")
        local = rank - self.first_rank
        return Coords(tp_rank=local % self.tp, dp_rank=(local // self.tp) % self.dp,
                      pp_rank=local // (self.tp * self.dp))

    def rank_of(self, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> int:
        assert 0 <= tp_rank < self.tp and 0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp
        return self.first_rank + tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    # Groups: every list is in ascending rank order, and the lists come in a fixed order.
    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: the tp x pp ranks that together hold one model replica."""
        return [sorted(self.rank_of(t, d, p) for p in range(self.pp) for t in range(self.tp))
                for d in range(self.dp)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pp group (they share tied embedding grads)."""
        return [sorted({group[0], group[-1]}) for group in self.pp_groups()]

    def group_of(self, groups: list[list[int]], rank: int) -> list[int]:
        for group in groups:
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is in none of the groups of {self}")

    def describe(self) -> str:
        return f"tp{self.tp} x dp{self.dp} x pp{self.pp} on ranks {self.first_rank}..{self.ranks[-1]}"

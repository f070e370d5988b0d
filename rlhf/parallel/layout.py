"""Pure rank <-> coordinate math for a TP x DP x PP layout (no torch.distributed).

Rank order follows Megatron: **tp fastest, then dp, then pp**. Within a mesh that starts at global rank
`first_rank`:

    rank = first_rank + tp_rank + tp * (dp_rank + dp * pp_rank)

so a TP group is a run of consecutive ranks (one node's NVLink domain) and pipeline stages are the
outermost blocks.

Expert parallelism (`ep`) is carved out of dp, as megatron's expert rank generator does (order
tp-ep-edp-pp, with the experts' tensor-parallel size equal to tp): dp rank d is expert-parallel rank
`d % ep` of expert-data-parallel replica `d // ep`. The dense layers see tp x dp x pp unchanged.
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
    """A tp x dp x pp layout of `tp * dp * pp` consecutive ranks starting at `first_rank`; experts split
    `ep` ways inside dp."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    first_rank: int = 0
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"layout {name}={value!r} must be a positive integer")
        if not isinstance(self.first_rank, int) or self.first_rank < 0:
            raise ConfigError(f"layout first_rank={self.first_rank!r} must be a non-negative integer")
        if self.dp % self.ep:
            raise ConfigError(f"layout ep={self.ep} does not divide dp={self.dp}: experts are split inside the data-"
                              f"parallel ranks; choose ep among the divisors of {self.dp}")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, first_rank: int = 0,
                  what: str = "layout", ep: int = 1) -> "ParallelLayout":
        """The layout filling `world_size` ranks with the given tp and pp (dp is what is left; ep divides it)."""
        if world_size % (tp * pp) != 0:
            raise ConfigError(
                f"{what}: {world_size} ranks are not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                f"choose tp and pp whose product divides {world_size}")
        if world_size % (tp * pp * ep) != 0:
            raise ConfigError(
                f"{what}: {world_size} ranks are not divisible by tp*ep*pp = {tp}*{ep}*{pp} = {tp * ep * pp}; "
                f"choose ep among the divisors of dp = {world_size // (tp * pp)}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), first_rank=first_rank, ep=ep)

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

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: dp / ep."""
        return self.dp // self.ep

    def ep_rank(self, rank: int) -> int:
        return self.coords(rank).dp_rank % self.ep

    def ep_groups(self) -> list[list[int]]:
        """Ranks that split one layer's experts: `ep` consecutive dp ranks (same tp rank, pp stage)."""
        return [[self.rank_of(t, e * self.ep + i, p) for i in range(self.ep)]
                for p in range(self.pp) for e in range(self.expert_dp) for t in range(self.tp)]

    def expert_dp_groups(self) -> list[list[int]]:
        """Ranks holding the same experts (same tp rank, ep rank and stage): their expert grads are averaged."""
        return [[self.rank_of(t, e * self.ep + i, p) for e in range(self.expert_dp)]
                for p in range(self.pp) for i in range(self.ep) for t in range(self.tp)]

    def tp_ep_groups(self) -> list[list[int]]:
        """tp x ep ranks of one stage and expert-dp replica (megatron's token dispatcher group)."""
        return [sorted(r for i in range(self.ep) for r in self.tp_groups_at(e * self.ep + i, p))
                for p in range(self.pp) for e in range(self.expert_dp)]

    def tp_ep_pp_groups(self) -> list[list[int]]:
        """tp x ep x pp ranks of one expert-dp replica: together they hold every expert once."""
        return [sorted(r for p in range(self.pp) for i in range(self.ep) for r in self.tp_groups_at(e * self.ep + i, p))
                for e in range(self.expert_dp)]

    def tp_groups_at(self, dp_rank: int, pp_rank: int) -> list[int]:
        return [self.rank_of(t, dp_rank, pp_rank) for t in range(self.tp)]

    def group_of(self, groups: list[list[int]], rank: int) -> list[int]:
        for group in groups:
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is in none of the groups of {self}")

    def describe(self) -> str:
        experts = f" (ep{self.ep})" if self.ep > 1 else ""
        return f"tp{self.tp} x dp{self.dp}{experts} x pp{self.pp} on ranks {self.first_rank}..{self.ranks[-1]}"

"""Pure rank <-> coordinate math for a TP x CP x DP x PP layout (no torch.distributed).

Rank order follows Megatron (`tp-cp-ep-dp-pp`): **tp fastest, then cp, then dp, then pp**. Within a mesh that
starts at global rank `first_rank`:

    rank = first_rank + tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a TP group is a run of consecutive ranks (one node's NVLink domain), the cp ranks sharing one sequence come
next, and pipeline stages are the outermost blocks. Context parallelism splits each sequence `cp` ways: the cp
ranks of one dp rank hold the same rows and the same weights, so weights and their gradients are data-parallel
over dp x cp (`dp_cp_groups`), data over dp alone.

Expert parallelism (`ep`) is carved out of the cp x dp ranks of a stage, as megatron's expert rank generator
does (order tp-ep-dp-pp over world / (tp * pp) ranks, the experts' tensor-parallel size equal to tp): the
stage's cp x dp index e = cp_rank + cp * dp_rank is expert-parallel rank `e % ep` of expert-data-parallel
replica `e // ep`. The dense layers see tp x cp x dp x pp unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from rlhf.errors import ConfigError


class Coords(NamedTuple):
    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    """A tp x cp x dp x pp layout of `tp * cp * dp * pp` consecutive ranks starting at `first_rank`; experts
    split `ep` ways inside cp x dp."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    first_rank: int = 0
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"layout {name}={value!r} must be a positive integer")
        if not isinstance(self.first_rank, int) or self.first_rank < 0:
            raise ConfigError(f"layout first_rank={self.first_rank!r} must be a non-negative integer")
        if self.cp == 1 and self.dp % self.ep:
            raise ConfigError(f"layout ep={self.ep} does not divide dp={self.dp}: experts are split inside the data-"
                              f"parallel ranks; choose ep among the divisors of {self.dp}")
        if (self.cp * self.dp) % self.ep:
            raise ConfigError(f"layout ep={self.ep} does not divide cp*dp = {self.cp}*{self.dp} = {self.cp * self.dp}: "
                              f"experts are split inside a stage's cp x dp ranks; choose ep among the divisors of "
                              f"{self.cp * self.dp}")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, first_rank: int = 0,
                  what: str = "layout", ep: int = 1, cp: int = 1) -> "ParallelLayout":
        """The layout filling `world_size` ranks with the given tp, cp and pp (dp is what is left; ep divides
        cp * dp)."""
        if cp == 1 and world_size % (tp * pp) != 0:
            raise ConfigError(
                f"{what}: {world_size} ranks are not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                f"choose tp and pp whose product divides {world_size}")
        if world_size % (tp * cp * pp) != 0:
            raise ConfigError(
                f"{what}: {world_size} ranks are not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {tp * cp * pp}; "
                f"choose tp, cp and pp whose product divides {world_size}")
        if world_size % (tp * pp * ep) != 0:
            raise ConfigError(
                f"{what}: {world_size} ranks are not divisible by tp*ep*pp = {tp}*{ep}*{pp} = {tp * ep * pp}; "
                f"choose ep among the divisors of {'dp' if cp == 1 else 'cp*dp'} = {world_size // (tp * pp)}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * cp * pp), first_rank=first_rank, ep=ep, cp=cp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.world_size)

    def contains(self, rank: int) -> bool:
        return self.first_rank <= rank < self.first_rank + self.world_size

    def coords(self, rank: int) -> Coords:
        if not self.contains(rank):
            raise ValueError(f"rank {rank} is outside {self}")
        local = rank - self.first_rank
        return Coords(tp_rank=local % self.tp, dp_rank=(local // (self.tp * self.cp)) % self.dp,
                      pp_rank=local // (self.tp * self.cp * self.dp), cp_rank=(local // self.tp) % self.cp)

    def rank_of(self, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0) -> int:
        assert 0 <= tp_rank < self.tp and 0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp
        assert 0 <= cp_rank < self.cp
        return self.first_rank + tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def _stage_rank(self, tp_rank: int, cp_dp_index: int, pp_rank: int) -> int:
        """The rank at a stage's cp x dp index `cp_rank + cp * dp_rank` (the experts' data-parallel axis)."""
        return self.first_rank + tp_rank + self.tp * (cp_dp_index + self.cp * self.dp * pp_rank)

    # Groups: every list is in ascending rank order, and the lists come in a fixed order.
    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p, c) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp) for c in range(self.cp)]

    def cp_groups(self) -> list[list[int]]:
        """The ranks that split one sequence: same tp rank, dp rank and stage."""
        return [[self.rank_of(t, d, p, c) for c in range(self.cp)]
                for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """The ranks that hold different rows: same tp rank, cp rank and stage."""
        return [[self.rank_of(t, d, p, c) for d in range(self.dp)]
                for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def dp_cp_groups(self) -> list[list[int]]:
        """The replicas of one weight shard (same tp rank and stage): gradients are averaged over them."""
        return [[self._stage_rank(t, e, p) for e in range(self.cp * self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def tp_cp_groups(self) -> list[list[int]]:
        return [sorted(self.rank_of(t, d, p, c) for c in range(self.cp) for t in range(self.tp))
                for p in range(self.pp) for d in range(self.dp)]

    def tp_dp_cp_groups(self) -> list[list[int]]:
        """Every rank of one stage."""
        return [sorted(self._stage_rank(t, e, p) for e in range(self.cp * self.dp) for t in range(self.tp))
                for p in range(self.pp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p, c) for p in range(self.pp)]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: the tp x pp ranks that together hold one model replica."""
        return [sorted(self.rank_of(t, d, p, c) for p in range(self.pp) for t in range(self.tp))
                for d in range(self.dp) for c in range(self.cp)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pp group (they share tied embedding grads)."""
        return [sorted({group[0], group[-1]}) for group in self.pp_groups()]

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: cp * dp / ep."""
        return self.cp * self.dp // self.ep

    def ep_rank(self, rank: int) -> int:
        coords = self.coords(rank)
        return (coords.cp_rank + self.cp * coords.dp_rank) % self.ep

    def ep_groups(self) -> list[list[int]]:
        """Ranks that split one layer's experts: `ep` consecutive cp x dp ranks (same tp rank, pp stage)."""
        return [[self._stage_rank(t, e * self.ep + i, p) for i in range(self.ep)]
                for p in range(self.pp) for e in range(self.expert_dp) for t in range(self.tp)]

    def expert_dp_groups(self) -> list[list[int]]:
        """Ranks holding the same experts (same tp rank, ep rank and stage): their expert grads are averaged."""
        return [[self._stage_rank(t, e * self.ep + i, p) for e in range(self.expert_dp)]
                for p in range(self.pp) for i in range(self.ep) for t in range(self.tp)]

    def tp_ep_groups(self) -> list[list[int]]:
        """tp x ep ranks of one stage and expert-dp replica (megatron's token dispatcher group)."""
        return [sorted(self._stage_rank(t, e * self.ep + i, p) for i in range(self.ep) for t in range(self.tp))
                for p in range(self.pp) for e in range(self.expert_dp)]

    def tp_ep_pp_groups(self) -> list[list[int]]:
        """tp x ep x pp ranks of one expert-dp replica: together they hold every expert once."""
        return [sorted(self._stage_rank(t, e * self.ep + i, p)
                       for p in range(self.pp) for i in range(self.ep) for t in range(self.tp))
                for e in range(self.expert_dp)]

    def group_of(self, groups: list[list[int]], rank: int) -> list[int]:
        for group in groups:
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is in none of the groups of {self}")

    def describe(self) -> str:
        experts = f" (ep{self.ep})" if self.ep > 1 else ""
        context = f" x cp{self.cp}" if self.cp > 1 else ""
        return (f"tp{self.tp}{context} x dp{self.dp}{experts} x pp{self.pp} on ranks "
                f"{self.first_rank}..{self.ranks[-1]}")

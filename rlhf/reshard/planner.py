"""The resharding planner: a pure function from (training layout, rollout layout, param specs) to transfers.

Each destination rank gets exactly the canonical slices its shards need (padding rows are zero-filled, never
sent). A slice is taken from the destination rank itself whenever it already holds it (colocated), otherwise
the ranks that need a source shard take its holders (DP and CP replicas; any tp rank for replicated tensors; for
an expert's weights only the cp x dp ranks of the expert-parallel rank holding it) in turn, so send load spreads
over the source ranks and the rule is a function of the two layouts alone:
`plan_rank` lists one rank's sends and receives without planning the others (0.2 s at 1024 ranks).
No torch.distributed here: plans are unit-tested on 64+ fake ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from rlhf.parallel.layout import ParallelLayout
from rlhf.errors import ConfigError
from rlhf.models.param_specs import ParamSpec, param_specs
from rlhf.reshard.segments import Segment, cut_dim, is_replicated, padding_rows, shard_segments
from rlhf.models.spec import ModelSpec

TIED_SOURCE = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Transfer:
    """`length` indices along `dim`: source shard [src_start, +length) -> destination shard [dst_start, +length)."""

    param: str  # global megatron name of the destination parameter
    src_rank: int
    dst_rank: int
    src_name: str  # the parameter's name in the source rank's model (stage-local layer index)
    dst_name: str  # ... and in the destination rank's model
    dim: int
    src_start: int
    dst_start: int
    length: int
    shape: tuple[int, ...]  # shape of the slice itself

    @cached_property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class DstShard:
    """One parameter shard a destination rank must end with; its last `padding_rows` rows are zeros."""

    rank: int
    param: str
    name: str  # stage-local name in the destination model
    shape: tuple[int, ...]
    padding_rows: int


@dataclass(frozen=True)
class ReshardPlan:
    """Every transfer of one (src, dst) resharding, in a fixed order all ranks agree on."""

    src_layout: ParallelLayout
    dst_layout: ParallelLayout
    transfers: tuple[Transfer, ...]
    dst_shards: tuple[DstShard, ...]

    def shards_of(self, rank: int) -> list[DstShard]:
        return [shard for shard in self.dst_shards if shard.rank == rank]

    def received_numel(self, rank: int) -> int:
        """Elements `rank` receives from other ranks (local copies excluded)."""
        return sum(t.numel for t in self.transfers if t.dst_rank == rank and not t.is_local)

    def sent_numel(self, rank: int) -> int:
        return sum(t.numel for t in self.transfers if t.src_rank == rank and not t.is_local)


def _slice_shape(spec: ParamSpec, tp: int, length: int) -> tuple[int, ...]:
    """Shape of `length` indices of a tp shard of `spec` along its cut dim."""
    shape = list(spec.shard_shape(tp))
    shape[cut_dim(spec)] = length
    return tuple(shape)


class _Planner:
    """Deterministic source choice, computable for one rank alone: a destination rank copies what it already
    holds; otherwise the ranks wanting a source shard (in rank order) take its holders round-robin, so the
    sending spreads over DP replicas and any rank can list its own sends without planning the others."""

    def __init__(self, src: ParallelLayout, dst: ParallelLayout, src_specs: Sequence[ParamSpec],
                 dst_specs: Sequence[ParamSpec], vocab_size: int):
        self.src, self.dst, self.vocab_size = src, dst, vocab_size
        self.src_by_name = {spec.name: spec for spec in src_specs if not spec.tied_copy}
        self.src_per_stage = _layers_per_stage(src_specs, src.pp)
        self.src_experts = _experts_per_rank(src_specs, src.ep)
        self.dst_specs = list(dst_specs)
        self.dst_per_stage = _layers_per_stage(dst_specs, dst.pp)
        self.dst_experts = _experts_per_rank(dst_specs, dst.ep)
        self._holders: dict[tuple[int, int | None, int | None], list[int]] = {}
        self._segments: dict[str, list[tuple[int, Segment]]] = {}
        self._dst_segments: dict[tuple[str, int], list[Segment]] = {}
        self._wanting: dict[tuple[str, int], dict[int, int]] = {}

    def source_of(self, dst_spec: ParamSpec) -> ParamSpec:
        name = TIED_SOURCE if dst_spec.tied_copy else dst_spec.name
        if name not in self.src_by_name:
            raise ConfigError(f"reshard: destination parameter {dst_spec.name!r} has no source parameter "
                              f"{name!r} in the training layout ({self.src.describe()})")
        return self.src_by_name[name]

    def holders(self, spec: ParamSpec, tp_rank: int) -> list[int]:
        """Source ranks holding tp rank `tp_rank`'s shard of `spec` (every tp rank for replicated tensors; an
        expert's weights only on its expert-parallel rank's dp ranks)."""
        ep_rank = spec.ep_rank(self.src_experts)
        key = (spec.pp_stage, None if is_replicated(spec) else tp_rank, ep_rank)
        if key not in self._holders:
            tp_ranks = range(self.src.tp) if is_replicated(spec) else [tp_rank]
            stage, cp = spec.pp_stage, self.src.cp
            # the stage's cp x dp indices e = cp_rank + cp * dp_rank (cp ranks hold the weights as dp ranks do);
            # an expert's only where e % ep is its ep rank (`ParallelLayout`)
            indices = [e for e in range(cp * self.src.dp) if ep_rank is None or e % self.src.ep == ep_rank]
            self._holders[key] = [self.src.rank_of(t, e // cp, stage, e % cp) for e in indices for t in tp_ranks]
        return self._holders[key]

    def src_segments(self, spec: ParamSpec) -> list[tuple[int, Segment]]:
        """(tp rank, segment) for every canonical run the training shards of `spec` hold."""
        if spec.name not in self._segments:
            tp_ranks = range(1 if is_replicated(spec) else self.src.tp)
            self._segments[spec.name] = [(t, seg) for t in tp_ranks
                                         for seg in shard_segments(spec, self.src.tp, t, self.vocab_size)]
        return self._segments[spec.name]

    def dst_segments(self, dst_spec: ParamSpec, tp_rank: int) -> list[Segment]:
        key = (dst_spec.name, tp_rank)
        if key not in self._dst_segments:
            self._dst_segments[key] = shard_segments(dst_spec, self.dst.tp, tp_rank, self.vocab_size)
        return self._dst_segments[key]

    def wanting(self, dst_spec: ParamSpec, src_tp_rank: int) -> dict[int, int]:
        """Destination rank -> its position among the ranks that need source tp shard `src_tp_rank` of
        `dst_spec`'s source and do not hold it (rank order)."""
        key = (dst_spec.name, src_tp_rank)
        if key not in self._wanting:
            spec = self.source_of(dst_spec)
            have = [seg for t, seg in self.src_segments(spec) if t == src_tp_rank]
            dst_tps = [t for t in range(self.dst.tp)
                       if any(_overlap(h, w) for h in have for w in self.dst_segments(dst_spec, t))]
            held = set(self.holders(spec, src_tp_rank))
            ranks = sorted(self.dst.rank_of(t, d, dst_spec.pp_stage) for d in range(self.dst.dp)
                           if _holds(dst_spec, self.dst, self.dst_experts, d) for t in dst_tps)
            self._wanting[key] = {rank: pos for pos, rank in enumerate(r for r in ranks if r not in held)}
        return self._wanting[key]

    def source_rank(self, dst_spec: ParamSpec, src_tp_rank: int, dst_rank: int) -> int:
        holders = self.holders(self.source_of(dst_spec), src_tp_rank)
        if dst_rank in holders:
            return dst_rank
        return holders[self.wanting(dst_spec, src_tp_rank)[dst_rank] % len(holders)]

    def transfers_into(self, dst_spec: ParamSpec, dst_rank: int, only_src: int | None = None) -> list[Transfer]:
        """Transfers filling `dst_rank`'s shard of `dst_spec` (those sent by `only_src` when given)."""
        spec = self.source_of(dst_spec)
        dim, src_name = cut_dim(spec), spec.local_name(self.src_per_stage, self.src_experts)
        dst_name = dst_spec.local_name(self.dst_per_stage, self.dst_experts)
        tp_rank_dst = self.dst.coords(dst_rank).tp_rank
        out = []
        for wanted in self.dst_segments(dst_spec, tp_rank_dst):
            for tp_rank, have in self.src_segments(spec):
                start, stop = max(have.canon_start, wanted.canon_start), min(have.canon_stop, wanted.canon_stop)
                if start >= stop:
                    continue
                src_rank = self.source_rank(dst_spec, tp_rank, dst_rank)
                if only_src is not None and src_rank != only_src:
                    continue
                out.append(Transfer(param=dst_spec.name, src_rank=src_rank, dst_rank=dst_rank, src_name=src_name,
                                    dst_name=dst_name, dim=dim,
                                    src_start=have.local_start + start - have.canon_start,
                                    dst_start=wanted.local_start + start - wanted.canon_start,
                                    length=stop - start, shape=_slice_shape(spec, self.src.tp, stop - start)))
        return out

    def received(self, rank: int) -> tuple[list[Transfer], list[DstShard]]:
        """Every transfer into `rank` (local copies included) and the rollout shards it ends with."""
        if not self.dst.contains(rank):
            return [], []
        tp_rank, dp_rank, pp_rank, _ = self.dst.coords(rank)
        transfers, shards = [], []
        for spec in self.dst_specs:
            if spec.pp_stage != pp_rank or not _holds(spec, self.dst, self.dst_experts, dp_rank):
                continue
            shape = spec.full_shape if spec.partition_dim is None else spec.shard_shape(self.dst.tp)
            shards.append(DstShard(rank=rank, param=spec.name, name=spec.local_name(self.dst_per_stage,
                                                                                    self.dst_experts),
                                   shape=shape, padding_rows=padding_rows(spec, self.dst.tp, tp_rank,
                                                                          self.vocab_size)))
            transfers += self.transfers_into(spec, rank)
        return transfers, shards

    def sent(self, rank: int) -> list[Transfer]:
        """Every transfer `rank` sends to another rank, in global plan order."""
        if not self.src.contains(rank):
            return []
        tp_rank, _, pp_rank, _ = self.src.coords(rank)
        by_dst: dict[int, list[ParamSpec]] = {}
        for dst_spec in self.dst_specs:
            spec = self.source_of(dst_spec)
            if spec.pp_stage != pp_rank:
                continue
            shard_tp = 0 if is_replicated(spec) else tp_rank
            holders = self.holders(spec, shard_tp)
            if rank not in holders:
                continue  # another expert-parallel rank's expert
            mine = holders.index(rank)
            for dst_rank, pos in self.wanting(dst_spec, shard_tp).items():
                if pos % len(holders) == mine:
                    by_dst.setdefault(dst_rank, []).append(dst_spec)
        return [t for dst_rank in sorted(by_dst) for dst_spec in by_dst[dst_rank]
                for t in self.transfers_into(dst_spec, dst_rank, only_src=rank)]


def _overlap(a: Segment, b: Segment) -> bool:
    return max(a.canon_start, b.canon_start) < min(a.canon_stop, b.canon_stop)


def _layers_per_stage(specs: Sequence[ParamSpec], pp: int) -> int:
    layers = {spec.layer for spec in specs if spec.layer is not None}
    return max(1, len(layers) // pp)


def _experts_per_rank(specs: Sequence[ParamSpec], ep: int) -> int:
    """Experts each expert-parallel rank holds (1 for a dense model, where no spec has an expert)."""
    num_experts = 1 + max((spec.expert for spec in specs if spec.expert is not None), default=0)
    return num_experts // ep


def _holds(spec: ParamSpec, layout: ParallelLayout, experts_per_rank: int, cp_dp_index: int) -> bool:
    """Whether the ranks at a stage's cp x dp index `cp_rank + cp * dp_rank` (the dp rank at cp = 1) of `layout`
    hold `spec` (all do, but for other ep ranks' experts)."""
    ep_rank = spec.ep_rank(experts_per_rank)
    return ep_rank is None or cp_dp_index % layout.ep == ep_rank


def _check_compatible(src_specs: Sequence[ParamSpec], dst_specs: Sequence[ParamSpec]) -> None:
    """ConfigError unless every rollout parameter has a training source of the same kind and shape."""
    src_by_name = {spec.name: spec for spec in src_specs if not spec.tied_copy}
    missing = sorted(spec.name for spec in dst_specs if not spec.tied_copy and spec.name not in src_by_name)
    if missing:
        raise ConfigError(f"reshard: parameters {missing[:5]} of the rollout model are not in the training model "
                          "(different architecture or head?)")
    for spec in dst_specs:
        source = src_by_name[TIED_SOURCE if spec.tied_copy else spec.name]
        unpadded = slice(1, None) if spec.kind == "vocab" else slice(None)  # vocab rows differ by padding only
        if source.kind != spec.kind or source.full_shape[unpadded] != spec.full_shape[unpadded]:
            raise ConfigError(f"reshard: {spec.name} is {spec.kind} {list(spec.full_shape)} in the rollout model "
                              f"but {source.kind} {list(source.full_shape)} in the training model")


def plan(src_layout: ParallelLayout, dst_layout: ParallelLayout, src_specs: Sequence[ParamSpec],
         dst_specs: Sequence[ParamSpec], *, vocab_size: int) -> ReshardPlan:
    """Transfers taking the model sharded as `src_specs` on `src_layout` to `dst_specs` on `dst_layout`.

    `*_specs` are `param_specs(hf_config, layout)` for each layout; `vocab_size` is the real (unpadded) vocab.
    """
    _check_compatible(src_specs, dst_specs)
    planner = _Planner(src_layout, dst_layout, src_specs, dst_specs, vocab_size)
    transfers: list[Transfer] = []
    shards: list[DstShard] = []
    for dst_rank in dst_layout.ranks:
        rank_transfers, rank_shards = planner.received(dst_rank)
        transfers += rank_transfers
        shards += rank_shards
    return ReshardPlan(src_layout=src_layout, dst_layout=dst_layout, transfers=tuple(transfers),
                       dst_shards=tuple(shards))


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a plan, computed without planning the other ranks (what `rlhf plan` reports at
    scale): `received` includes its local copies, `sent` only what goes to other ranks."""

    rank: int
    received: tuple[Transfer, ...]
    sent: tuple[Transfer, ...]
    dst_shards: tuple[DstShard, ...]

    @property
    def received_numel(self) -> int:
        return sum(t.numel for t in self.received if not t.is_local)

    @property
    def sent_numel(self) -> int:
        return sum(t.numel for t in self.sent)


def plan_rank(src_layout: ParallelLayout, dst_layout: ParallelLayout, src_specs: Sequence[ParamSpec],
              dst_specs: Sequence[ParamSpec], *, vocab_size: int, rank: int) -> RankPlan:
    """`rank`'s transfers of `plan(...)` (same transfers, same order), planned for that rank alone."""
    _check_compatible(src_specs, dst_specs)
    planner = _Planner(src_layout, dst_layout, src_specs, dst_specs, vocab_size)
    received, shards = planner.received(rank)
    return RankPlan(rank=rank, received=tuple(received), sent=tuple(planner.sent(rank)), dst_shards=tuple(shards))


def plan_for_model(hf_config: Any, src_layout: ParallelLayout, dst_layout: ParallelLayout, *,
                   value_head: bool = False) -> ReshardPlan:
    """`plan` for the model `hf_config` describes (specs and vocab size derived from it)."""
    vocab_size = ModelSpec.from_hf(hf_config).vocab_size
    return plan(src_layout, dst_layout, param_specs(hf_config, src_layout, value_head=value_head),
                param_specs(hf_config, dst_layout, value_head=value_head), vocab_size=vocab_size)


def min_received_numel(src_layout: ParallelLayout, dst_layout: ParallelLayout, src_specs: Sequence[ParamSpec],
                       dst_specs: Sequence[ParamSpec], *, vocab_size: int, rank: int) -> int:
    """The least `rank` must receive: its rollout shards' real elements minus those it already holds.

    Computed from intervals alone (no source choice), as the yardstick for plans and benchmarks.
    """
    if not dst_layout.contains(rank):
        return 0
    src_by_name = {spec.name: spec for spec in src_specs if not spec.tied_copy}
    tp_rank, dp_rank, pp_rank, _ = dst_layout.coords(rank)
    held_coords = src_layout.coords(rank) if src_layout.contains(rank) else None
    src_experts, dst_experts = _experts_per_rank(src_specs, src_layout.ep), _experts_per_rank(dst_specs, dst_layout.ep)
    total = 0
    for spec in dst_specs:
        if spec.pp_stage != pp_rank or not _holds(spec, dst_layout, dst_experts, dp_rank):
            continue
        source = src_by_name[TIED_SOURCE if spec.tied_copy else spec.name]
        held = []
        if (held_coords is not None and source.pp_stage == held_coords.pp_rank
                and _holds(source, src_layout, src_experts, held_coords.cp_rank + src_layout.cp * held_coords.dp_rank)):
            held = shard_segments(source, src_layout.tp, held_coords.tp_rank, vocab_size)
        row_numel = 1
        for dim, size in enumerate(spec.full_shape):
            row_numel *= 1 if dim == cut_dim(spec) else size
        for want in shard_segments(spec, dst_layout.tp, tp_rank, vocab_size):
            overlap = sum(max(0, min(want.canon_stop, h.canon_stop) - max(want.canon_start, h.canon_start))
                          for h in held)
            total += (want.length - overlap) * row_numel
    return total

"""The resharding planner: a pure function from (training layout, rollout layout, param specs) to transfers.

Each destination rank gets exactly the canonical slices its shards need (padding rows are zero-filled, never
sent). A slice is taken from the destination rank itself whenever it already holds it (colocated), otherwise
from the least-loaded of the source replicas holding it (DP replicas; any tp rank for replicated tensors; for
an expert's weights only the dp ranks of the expert-parallel rank holding it), so send load spreads over the
source ranks. No torch.distributed here: plans are unit-tested on 64+ fake ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from rlhf.dist.layout import ParallelLayout
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
    """Greedy, deterministic source choice; `sent` tracks elements each source rank sends so far."""

    def __init__(self, src: ParallelLayout, dst: ParallelLayout, src_specs: Sequence[ParamSpec], vocab_size: int):
        self.src, self.dst, self.vocab_size = src, dst, vocab_size
        self.src_by_name = {spec.name: spec for spec in src_specs if not spec.tied_copy}
        self.src_per_stage = _layers_per_stage(src_specs, src.pp)
        self.src_experts = _experts_per_rank(src_specs, src.ep)
        self.sent = {rank: 0 for rank in src.ranks}
        self.transfers: list[Transfer] = []
        self._holders: dict[tuple[int, int | None, int | None], list[int]] = {}
        self._segments: dict[str, list[tuple[int, Segment]]] = {}

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
            dp_ranks = [d for d in range(self.src.dp) if ep_rank is None or d % self.src.ep == ep_rank]
            stage = spec.pp_stage
            self._holders[key] = [self.src.rank_of(t, d, stage) for d in dp_ranks for t in tp_ranks]
        return self._holders[key]

    def src_segments(self, spec: ParamSpec) -> list[tuple[int, Segment]]:
        """(tp rank, segment) for every canonical run the training shards of `spec` hold."""
        if spec.name not in self._segments:
            tp_ranks = range(1 if is_replicated(spec) else self.src.tp)
            self._segments[spec.name] = [(t, seg) for t in tp_ranks
                                         for seg in shard_segments(spec, self.src.tp, t, self.vocab_size)]
        return self._segments[spec.name]

    def add(self, dst_spec: ParamSpec, dst_rank: int, dst_name: str, wanted: Segment) -> None:
        spec = self.source_of(dst_spec)
        dim, src_name = cut_dim(spec), spec.local_name(self.src_per_stage, self.src_experts)
        for tp_rank, have in self.src_segments(spec):
            start, stop = max(have.canon_start, wanted.canon_start), min(have.canon_stop, wanted.canon_stop)
            if start >= stop:
                continue
            holders = self.holders(spec, tp_rank)
            src_rank = dst_rank if dst_rank in holders else min(holders, key=lambda r: (self.sent[r], r))
            transfer = Transfer(param=dst_spec.name, src_rank=src_rank, dst_rank=dst_rank, src_name=src_name,
                                dst_name=dst_name, dim=dim, src_start=have.local_start + start - have.canon_start,
                                dst_start=wanted.local_start + start - wanted.canon_start, length=stop - start,
                                shape=_slice_shape(spec, self.src.tp, stop - start))
            if not transfer.is_local:
                self.sent[src_rank] += transfer.numel
            self.transfers.append(transfer)


def _layers_per_stage(specs: Sequence[ParamSpec], pp: int) -> int:
    layers = {spec.layer for spec in specs if spec.layer is not None}
    return max(1, len(layers) // pp)


def _experts_per_rank(specs: Sequence[ParamSpec], ep: int) -> int:
    """Experts each expert-parallel rank holds (1 for a dense model, where no spec has an expert)."""
    num_experts = 1 + max((spec.expert for spec in specs if spec.expert is not None), default=0)
    return num_experts // ep


def _holds(spec: ParamSpec, layout: ParallelLayout, experts_per_rank: int, dp_rank: int) -> bool:
    """Whether the ranks of dp rank `dp_rank` of `layout` hold `spec` (all do, but for other ep ranks' experts)."""
    ep_rank = spec.ep_rank(experts_per_rank)
    return ep_rank is None or dp_rank % layout.ep == ep_rank


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
    planner = _Planner(src_layout, dst_layout, src_specs, vocab_size)
    dst_per_stage = _layers_per_stage(dst_specs, dst_layout.pp)
    dst_experts = _experts_per_rank(dst_specs, dst_layout.ep)
    shards: list[DstShard] = []
    for dst_rank in dst_layout.ranks:
        tp_rank, dp_rank, pp_rank = dst_layout.coords(dst_rank)
        for spec in dst_specs:
            if spec.pp_stage != pp_rank or not _holds(spec, dst_layout, dst_experts, dp_rank):
                continue
            name = spec.local_name(dst_per_stage, dst_experts)
            shape = spec.full_shape if spec.partition_dim is None else spec.shard_shape(dst_layout.tp)
            shards.append(DstShard(rank=dst_rank, param=spec.name, name=name, shape=shape,
                                   padding_rows=padding_rows(spec, dst_layout.tp, tp_rank, vocab_size)))
            for wanted in shard_segments(spec, dst_layout.tp, tp_rank, vocab_size):
                planner.add(spec, dst_rank, name, wanted)
    return ReshardPlan(src_layout=src_layout, dst_layout=dst_layout, transfers=tuple(planner.transfers),
                       dst_shards=tuple(shards))


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
    tp_rank, dp_rank, pp_rank = dst_layout.coords(rank)
    held_coords = src_layout.coords(rank) if src_layout.contains(rank) else None
    src_experts, dst_experts = _experts_per_rank(src_specs, src_layout.ep), _experts_per_rank(dst_specs, dst_layout.ep)
    total = 0
    for spec in dst_specs:
        if spec.pp_stage != pp_rank or not _holds(spec, dst_layout, dst_experts, dp_rank):
            continue
        source = src_by_name[TIED_SOURCE if spec.tied_copy else spec.name]
        held = []
        if (held_coords is not None and source.pp_stage == held_coords.pp_rank
                and _holds(source, src_layout, src_experts, held_coords.dp_rank)):
            held = shard_segments(source, src_layout.tp, held_coords.tp_rank, vocab_size)
        row_numel = 1
        for dim, size in enumerate(spec.full_shape):
            row_numel *= 1 if dim == cut_dim(spec) else size
        for want in shard_segments(spec, dst_layout.tp, tp_rank, vocab_size):
            overlap = sum(max(0, min(want.canon_stop, h.canon_stop) - max(want.canon_start, h.canon_start))
                          for h in held)
            total += (want.length - overlap) * row_numel
    return total

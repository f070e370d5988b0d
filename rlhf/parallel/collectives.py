"""Bucketed all_reduce / all_gather / broadcast over a list or dict of tensors.

Small tensors are coalesced into per-dtype flat buffers (>= `min_bucket_mb`), planned identically on every
rank from (name, shape, dtype); every rank issues every bucket's collective and waits on every handle.
`verify=True` compares layout fingerprints first, so a disagreement raises instead of hanging.
Strategies: `bucket` (default), `rs_ag` (reduce_scatter + all_gather per bucket; all_reduce only, the
others treat it as `bucket`), `plain` (one collective per tensor, the baseline).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, TypeVar

import torch
import torch.distributed as dist

from rlhf.parallel import inflight
from rlhf.parallel.buckets import Bucket, bucket_bytes, canonical_entries, plan_buckets, specs_of
from rlhf.parallel.fingerprint import CallLayout, verify_layout, wait
from rlhf.errors import ConfigError

Strategy = Literal["bucket", "rs_ag", "plain"]
ReduceName = Literal["sum", "avg", "max", "min", "product"]
STRATEGIES: tuple[str, ...] = ("bucket", "rs_ag", "plain")
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}

Tensors = TypeVar("Tensors", Sequence[torch.Tensor], Mapping[str, torch.Tensor])


class _Call:
    """One collective call's entries, plan and options, shared by the three public functions."""

    def __init__(self, kind: str, tensors, *, group, strategy: str, min_bucket_mb: float, name: str,
                 options: str) -> None:
        if strategy not in STRATEGIES:
            raise ConfigError(f"comm.strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
        self.group = group
        self.strategy = strategy
        self.names, self.tensors = canonical_entries(tensors)
        self.specs = specs_of(self.names, self.tensors)
        self.buckets = plan_buckets(self.specs, 0 if strategy == "plain" else bucket_bytes(min_bucket_mb))
        # Strategy and bucket size decide how many collectives run, so ranks must agree on them too.
        sizing = "" if strategy == "plain" else f", min_bucket_mb={min_bucket_mb:g}"
        call_text = f"{kind}({options}{', ' if options else ''}strategy={strategy}{sizing})"
        self.label = f"{name}: {call_text} {len(self.specs)} tensors"
        self.layout = CallLayout(call=call_text, specs=tuple(self.specs))

    def flat(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's tensors as one contiguous 1-D buffer (the tensor itself when alone and contiguous)."""
        if bucket.is_solo and self.tensors[bucket.entries[0]].is_contiguous():
            return self.tensors[bucket.entries[0]].view(-1)
        return torch.cat([self.tensors[index].reshape(-1) for index in bucket.entries])

    def unflatten(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Copy a reduced/received buffer back into the caller's tensors (skipped when it is their storage)."""
        for index, offset in zip(bucket.entries, bucket.offsets_elems):
            target = self.tensors[index]
            if flat.data_ptr() == target.data_ptr() and bucket.is_solo:
                continue
            target.copy_(flat[offset:offset + target.numel()].view(target.shape))


def _start(call: _Call, verify: bool, timeout_s: float | None) -> None:
    if verify:
        verify_layout(call.layout, call.group, timeout_s)


def _wait_all(works: list, call: _Call, timeout_s: float | None) -> None:
    for work in works:
        wait(work, timeout_s, call.label)


@torch.no_grad()
def all_reduce(tensors: Tensors, *, op: ReduceName = "sum", group: dist.ProcessGroup | None = None,
               strategy: Strategy = "bucket", min_bucket_mb: float = 1.0, verify: bool = False,
               timeout_s: float | None = None, name: str = "all_reduce") -> Tensors:
    """Reduce every tensor across `group` in place; `avg` is the sum divided by the group size."""
    if op not in _REDUCE_OPS:
        raise ConfigError(f"all_reduce op={op!r} is not one of {', '.join(_REDUCE_OPS)}")
    call = _Call("all_reduce", tensors, group=group, strategy=strategy, min_bucket_mb=min_bucket_mb,
                 name=name, options=f"op={op}")
    if op == "avg":
        integral = [spec.describe() for spec in call.specs if not spec.dtype.is_floating_point]
        if integral:
            raise ConfigError(f"all_reduce op='avg' needs floating tensors; got {integral[0]}; use op='sum'")
    with inflight.track(call.label):
        _start(call, verify, timeout_s)
        buckets = [bucket for bucket in call.buckets if bucket.numel > 0]
        flats = [call.flat(bucket) for bucket in buckets]
        if strategy == "rs_ag":
            _reduce_scatter_all_gather(flats, call, _REDUCE_OPS[op], timeout_s)
        else:
            works = [dist.all_reduce(flat, op=_REDUCE_OPS[op], group=group, async_op=True) for flat in flats]
            _wait_all(works, call, timeout_s)
        world_size = dist.get_world_size(group)
        for bucket, flat in zip(buckets, flats):
            if op == "avg":
                flat.div_(world_size)
            call.unflatten(bucket, flat)
    return tensors


def _reduce_scatter_all_gather(flats: list[torch.Tensor], call: _Call, op: dist.ReduceOp,
                               timeout_s: float | None) -> None:
    """All-reduce each buffer as reduce_scatter then all_gather, padding it to a multiple of the group size."""
    world_size = dist.get_world_size(call.group)
    padded = [torch.cat([flat, flat.new_zeros(-flat.numel() % world_size)]) for flat in flats]
    shards = [buffer.new_empty(buffer.numel() // world_size) for buffer in padded]
    _wait_all([dist.reduce_scatter_single(shard, buffer, op=op, group=call.group, async_op=True)
               for shard, buffer in zip(shards, padded)], call, timeout_s)
    _wait_all([dist.all_gather_single(buffer, shard, group=call.group, async_op=True)
               for shard, buffer in zip(shards, padded)], call, timeout_s)
    for flat, buffer in zip(flats, padded):
        flat.copy_(buffer[:flat.numel()])


@torch.no_grad()
def all_gather(tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], *,
               group: dist.ProcessGroup | None = None, strategy: Strategy = "bucket",
               min_bucket_mb: float = 1.0, verify: bool = False, timeout_s: float | None = None,
               name: str = "all_gather") -> list[list[torch.Tensor]] | dict[str, list[torch.Tensor]]:
    """Gather every tensor from every rank: per input, a list indexed by group rank (views of one buffer)."""
    call = _Call("all_gather", tensors, group=group, strategy=strategy, min_bucket_mb=min_bucket_mb,
                 name=name, options="")
    world_size = dist.get_world_size(group)
    gathered: list[list[torch.Tensor]] = [[] for _ in call.tensors]
    with inflight.track(call.label):
        _start(call, verify, timeout_s)
        flats = [call.flat(bucket) for bucket in call.buckets]
        outputs = [flat.new_empty(world_size * flat.numel()) for flat in flats]
        works = [dist.all_gather_single(out, flat, group=group, async_op=True)
                 for out, flat in zip(outputs, flats) if flat.numel() > 0]
        _wait_all(works, call, timeout_s)
    for bucket, out in zip(call.buckets, outputs):
        per_rank = out.view(world_size, bucket.numel)
        for index, offset in zip(bucket.entries, bucket.offsets_elems):
            spec = call.specs[index]
            gathered[index] = [per_rank[rank, offset:offset + spec.numel].view(spec.shape)
                               for rank in range(world_size)]
    if isinstance(tensors, Mapping):
        return dict(zip(call.names, gathered))
    return gathered


@torch.no_grad()
def broadcast(tensors: Tensors, *, src: int, group: dist.ProcessGroup | None = None,
              strategy: Strategy = "bucket", min_bucket_mb: float = 1.0, verify: bool = False,
              timeout_s: float | None = None, name: str = "broadcast") -> Tensors:
    """Overwrite every tensor in place with global rank `src`'s values."""
    members = dist.get_process_group_ranks(group or dist.group.WORLD)
    if src not in members:
        raise ConfigError(f"broadcast src={src} is not a rank of the group (ranks {members})")
    call = _Call("broadcast", tensors, group=group, strategy=strategy, min_bucket_mb=min_bucket_mb,
                 name=name, options=f"src={src}")
    is_src = dist.get_rank() == src
    with inflight.track(call.label):
        _start(call, verify, timeout_s)
        buckets = [bucket for bucket in call.buckets if bucket.numel > 0]
        flats = [call.flat(bucket) for bucket in buckets]
        works = [dist.broadcast(flat, src=src, group=group, async_op=True) for flat in flats]
        _wait_all(works, call, timeout_s)
        if not is_src:
            for bucket, flat in zip(buckets, flats):
                call.unflatten(bucket, flat)
    return tensors


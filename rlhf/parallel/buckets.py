"""Pure bucket planning for coalesced collectives: which tensors share a flat buffer, at which offsets.

The plan depends only on each entry's (name, shape, dtype) and the bucket size, so every rank derives the
same plan from the same list without talking to the others (no torch.distributed here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rlhf.errors import ConfigError

MIB = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    """What a rank must agree on with its peers about one tensor of a collective."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        return f"{self.name!r} shape {tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class Bucket:
    """Tensors of one dtype sharing a flat buffer: `entries` index the spec list, `offsets_elems` the buffer."""

    dtype: torch.dtype
    entries: tuple[int, ...]
    offsets_elems: tuple[int, ...]
    numel: int

    @property
    def is_solo(self) -> bool:
        return len(self.entries) == 1


def canonical_entries(tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
                      ) -> tuple[list[str], list[torch.Tensor]]:
    """Names and tensors in the order every rank uses: a dict sorted by name, a list by position (`[i]`)."""
    if isinstance(tensors, Mapping):
        names = sorted(tensors)
        return names, [tensors[name] for name in names]
    tensor_list = list(tensors)
    return [f"[{index}]" for index in range(len(tensor_list))], tensor_list


def specs_of(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in zip(names, tensors, strict=True)]


def bucket_bytes(min_bucket_mb: float) -> int:
    """`min_bucket_mb` as bytes; 0 puts every tensor alone (the per-tensor behaviour)."""
    if not isinstance(min_bucket_mb, (int, float)) or isinstance(min_bucket_mb, bool) \
            or not math.isfinite(min_bucket_mb) or min_bucket_mb < 0:
        raise ConfigError(f"comm.min_bucket_mb={min_bucket_mb!r} must be a finite number >= 0 (default 1.0)")
    return int(min_bucket_mb * MIB)


def plan_buckets(specs: Sequence[TensorSpec], min_bucket_bytes: int) -> tuple[Bucket, ...]:
    """Group same-dtype tensors in spec order into buffers that close once they hold `min_bucket_bytes`.

    A tensor of at least `min_bucket_bytes` gets a bucket of its own. Dtypes go in the order of their names.
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, spec in enumerate(specs):
        by_dtype.setdefault(spec.dtype, []).append(index)
    buckets: list[Bucket] = []
    for dtype in sorted(by_dtype, key=str):
        pending: list[int] = []
        pending_bytes = 0
        for index in by_dtype[dtype]:
            nbytes = specs[index].nbytes
            if nbytes >= min_bucket_bytes:
                buckets.append(_bucket(specs, dtype, [index]))
                continue
            pending.append(index)
            pending_bytes += nbytes
            if pending_bytes >= min_bucket_bytes:
                buckets.append(_bucket(specs, dtype, pending))
                pending, pending_bytes = [], 0
        if pending:
            buckets.append(_bucket(specs, dtype, pending))
    return tuple(buckets)


def _bucket(specs: Sequence[TensorSpec], dtype: torch.dtype, entries: list[int]) -> Bucket:
    offsets = []
    numel = 0
    for index in entries:
        offsets.append(numel)
        numel += specs[index].numel
    return Bucket(dtype=dtype, entries=tuple(entries), offsets_elems=tuple(offsets), numel=numel)

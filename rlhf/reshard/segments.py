"""Slice-level view of the models layer's shard rules: which canonical rows/columns a tp shard holds, and where.

Every `ParamSpec` kind is cut along one dim (`partition_dim`, or dim 0 for `replicated`). A *canonical* index
along that dim names an element independently of tp, so shards at different tp degrees can be matched:

- `row`, `qkv`: the full megatron tensor (qkv is interleaved per query group, and tp ranks own whole groups,
  so a shard is one contiguous run of full rows at every tp);
- `gate_up`: the [gate; up] concatenation -- a shard holds two runs, its gate rows then its up rows;
- `vocab`: the real vocabulary rows [0, vocab_size) -- padding rows exist only in shards and are zeros;
- `rows`: contiguous blocks of dim 0 (a LoRA B of a column-parallel linear);
- `replicated`: the whole tensor, held by every tp rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.models.param_specs import ParamSpec


@dataclass(frozen=True)
class Segment:
    """`length` consecutive indices along the cut dim: shard-local `local_start` holds canonical `canon_start`."""

    local_start: int
    canon_start: int
    length: int

    @property
    def canon_stop(self) -> int:
        return self.canon_start + self.length


def cut_dim(spec: ParamSpec) -> int:
    """The dim a shard of `spec` is cut along (0 for replicated tensors, which are never cut)."""
    return 0 if spec.partition_dim is None else spec.partition_dim


def is_replicated(spec: ParamSpec) -> bool:
    return spec.kind == "replicated"


def shard_segments(spec: ParamSpec, tp: int, tp_rank: int, vocab_size: int) -> list[Segment]:
    """The canonical runs tp rank `tp_rank` of `tp` holds of `spec` (whose `full_shape` is for that tp)."""
    if is_replicated(spec):
        return [Segment(0, 0, spec.full_shape[0])]
    size = spec.full_shape[cut_dim(spec)] // tp
    if spec.kind == "gate_up":
        half, ffn = size // 2, spec.full_shape[0] // 2
        return [Segment(0, tp_rank * half, half), Segment(half, ffn + tp_rank * half, half)]
    if spec.kind == "vocab":
        real = min(size, vocab_size - tp_rank * size)
        return [Segment(0, tp_rank * size, real)] if real > 0 else []
    assert spec.kind in ("row", "rows", "qkv"), spec.kind
    return [Segment(0, tp_rank * size, size)]


def padding_rows(spec: ParamSpec, tp: int, tp_rank: int, vocab_size: int) -> int:
    """How many trailing shard rows of a `vocab` parameter are padding (zeros) on this tp rank."""
    if spec.kind != "vocab":
        return 0
    size = spec.full_shape[0] // tp
    return size - sum(seg.length for seg in shard_segments(spec, tp, tp_rank, vocab_size))

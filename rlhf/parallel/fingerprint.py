"""Layout fingerprints: ranks compare what they are about to run before running it.

A mismatch (count, names, shapes, dtypes, op) otherwise hangs or silently corrupts; here every rank raises
`CollectiveMismatchError` naming the disagreeing ranks and the first differing tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rlhf.errors import CollectiveMismatchError
from rlhf.parallel.buckets import TensorSpec
from rlhf.parallel.wire import all_gather_json, collective_device


@dataclass(frozen=True)
class CallLayout:
    """One rank's view of a collective call: its kind and options (`call`) and its tensors."""

    call: str
    specs: tuple[TensorSpec, ...]

    def to_json(self) -> dict:
        return {"call": self.call, "specs": [[s.name, list(s.shape), str(s.dtype).removeprefix("torch.")]
                                             for s in self.specs]}

    @classmethod
    def from_json(cls, data: dict) -> CallLayout:
        specs = []
        for name, shape, dtype in data["specs"]:
            torch_dtype = getattr(torch, dtype, None)
            if not isinstance(torch_dtype, torch.dtype):
                raise CollectiveMismatchError(f"a peer described tensor {name!r} with unknown dtype {dtype!r}")
            specs.append(TensorSpec(name=name, shape=tuple(shape), dtype=torch_dtype))
        return cls(call=data["call"], specs=tuple(specs))

    def fingerprint(self) -> list[int]:
        """Five int64 numbers: count, then hashes of the names, shapes, dtypes and call."""
        return [len(self.specs),
                _hash64(spec.name for spec in self.specs),
                _hash64(str(spec.shape) for spec in self.specs),
                _hash64(str(spec.dtype) for spec in self.specs),
                _hash64([self.call])]


def _hash64(parts) -> int:
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def verify_layout(layout: CallLayout, group: dist.ProcessGroup | None, timeout_s: float | None) -> None:
    """All-gather fingerprints; if any differ, exchange full layouts and raise on every rank."""
    world_size = dist.get_world_size(group)
    device = collective_device(group)
    mine = torch.tensor(layout.fingerprint(), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    wait(work, timeout_s, f"fingerprint exchange for {layout.call}")
    if all(torch.equal(other, gathered[0]) for other in gathered[1:]):
        return
    layouts = [CallLayout.from_json(item) for item in all_gather_json(layout.to_json(), group=group)]
    raise CollectiveMismatchError(describe_mismatch(layouts, dist.get_process_group_ranks(group or dist.group.WORLD)))


def wait(work: dist.Work, timeout_s: float | None, what: str) -> None:
    """Wait for one async collective; past `timeout_s` raise `TimeoutError` naming it."""
    if timeout_s is None:
        work.wait()
        return
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        if "timed out" not in str(exc).lower():
            raise
        raise TimeoutError(f"{what} did not complete within {timeout_s:g}s (a peer rank never joined?)") from exc


def describe_mismatch(layouts: Sequence[CallLayout], ranks: Sequence[int]) -> str:
    """Name the majority layout's ranks, each dissenting group of ranks, and its first differing tensor."""
    groups: dict[CallLayout, list[int]] = {}
    for rank, layout in zip(ranks, layouts, strict=True):
        groups.setdefault(layout, []).append(rank)
    reference = max(groups, key=lambda key: (len(groups[key]), -min(groups[key])))
    lines = [f"collective layouts differ across {len(ranks)} ranks (ranks {groups[reference]} agree "
             f"on {reference.call} with {len(reference.specs)} tensors):"]
    for layout, members in groups.items():
        if layout is not reference:
            lines.append(f"  ranks {members}: {_first_difference(reference, layout)}")
    return "\n".join(lines)


def _first_difference(reference: CallLayout, other: CallLayout) -> str:
    if reference.call != other.call:
        return f"call {other.call} instead of {reference.call}"
    for index, (want, got) in enumerate(zip(reference.specs, other.specs)):
        if want != got:
            return f"tensor #{index} is {got.describe()}, expected {want.describe()}"
    shorter, longer = sorted((reference.specs, other.specs), key=len)
    missing = longer[len(shorter)]
    side = "extra" if longer is other.specs else "missing"
    return (f"{len(other.specs)} tensors instead of {len(reference.specs)}; first {side} tensor is "
            f"#{len(shorter)} {missing.describe()}")

"""Plain data between ranks without pickle: raw bytes and JSON objects ride in uint8 tensors.

`torch.distributed.*_object` collectives unpickle what peers send; these never do. Sizes travel first, then
the payloads padded to the longest, so every rank issues the same collectives whatever its payload.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from rlhf.platform import current_device


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where tensors for this group's collectives must live (gloo: host memory)."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else current_device()


def all_gather_bytes(payload: bytes, *, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `payload` (any length, empty included) in group-rank order."""
    device = collective_device(group)
    world_size = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    buffer = torch.zeros(max(max(lengths), 1), dtype=torch.uint8)
    if payload:
        buffer[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buffer = buffer.to(device)
    parts = [torch.empty_like(buffer) for _ in range(world_size)]
    dist.all_gather(parts, buffer, group=group)
    return [part[:length].cpu().numpy().tobytes() for part, length in zip(parts, lengths)]


def all_gather_json(value: Any, *, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's JSON-serialisable `value` in group-rank order (without a process group: this process's)."""
    if not dist.is_initialized():
        return [json.loads(json.dumps(value))]
    return [json.loads(part) for part in all_gather_bytes(json.dumps(value).encode(), group=group)]


def broadcast_json(value: Any, *, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Global rank `src`'s JSON-serialisable `value` on every rank of `group` (others pass anything)."""
    mine = json.dumps(value).encode() if dist.get_rank() == src else b""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return json.loads(all_gather_bytes(mine, group=group)[ranks.index(src)])

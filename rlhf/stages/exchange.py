"""Moving per-sample data between role meshes: every rank ends up with the global batch, each role works on its
DP shard, and the shard results are gathered back so the next stage (on any mesh) sees the whole batch.

One rank per replica contributes (tp_rank 0, last pipeline stage) so nothing is counted twice. This works the
same for colocated and split placements; it moves per-sample tensors (tokens, logprobs), never weights.
Tensor collectives only, never pickled objects: the contributors' field names, shapes and dtypes go as JSON,
then each contributor broadcasts its fields as one flat byte buffer, so every rank receives each replica's
rows exactly once (the minimum for a global batch), not one copy per rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from rlhf.parallel.layout import ParallelLayout
from rlhf.parallel.wire import all_gather_json, collective_device
from rlhf.stages.batch import RolloutBatch


def is_contributor(layout: ParallelLayout, rank: int) -> bool:
    """The rank that speaks for its replica: tp_rank 0 and cp_rank 0 on the last pipeline stage."""
    if not layout.contains(rank):
        return False
    coords = layout.coords(rank)
    return coords.tp_rank == 0 and coords.cp_rank == 0 and coords.pp_rank == layout.pp - 1


def _pad_to(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    if tensor.shape[1] == width:
        return tensor
    pad = torch.full((tensor.shape[0], width - tensor.shape[1], *tensor.shape[2:]), value, dtype=tensor.dtype)
    return torch.cat([tensor, pad], dim=1)


def concat_batches(batches: list[RolloutBatch], prompts_per_batch: list[int]) -> RolloutBatch:
    """Stack batches row-wise, padding sequence/response widths; group indices become global."""
    seq_width = max(b.tokens_bs.shape[1] for b in batches)
    resp_width = max(b.response_width for b in batches)
    offsets = torch.tensor([0] + prompts_per_batch[:-1]).cumsum(0).tolist()
    merged = {}
    for field in dataclasses.fields(batches[0]):
        values = [getattr(b, field.name) for b in batches]
        if not isinstance(values[0], torch.Tensor):
            continue
        if field.name == "tokens_bs":
            values = [_pad_to(v, seq_width, batches[0].pad_token_id) for v in values]
        elif field.name.endswith("_bt"):
            values = [_pad_to(v, resp_width, False if v.dtype == torch.bool else 0) for v in values]
        elif field.name.endswith("_bslk"):  # routing: unknown (-1) on the padding
            values = [_pad_to(v, seq_width, -1) for v in values]
        elif field.name == "group_index_b":
            values = [v + offset for v, offset in zip(values, offsets)]
        merged[field.name] = torch.cat(values)
    return dataclasses.replace(batches[0], **merged)


def group_shard(batch: RolloutBatch, index: int, count: int) -> RolloutBatch:
    """The `index`-th of `count` equal, contiguous ranges of a batch's groups, numbered from 0 (concat_batches
    of the shards in order gives the batch back)."""
    num_groups = int(batch.group_index_b.max()) + 1
    assert num_groups % count == 0, (num_groups, count)
    per = num_groups // count
    rows_b = (batch.group_index_b >= index * per) & (batch.group_index_b < (index + 1) * per)
    shard = batch.select(rows_b)
    return dataclasses.replace(shard, group_index_b=shard.group_index_b - index * per)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    assert isinstance(dtype, torch.dtype), f"not a torch dtype: {name!r}"
    return dtype


def _describe(tensors: dict[str, torch.Tensor]) -> list:
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()]


def _pack(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def _unpack(described: list, flat_u8: torch.Tensor) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape, dtype_name in described:
        dtype = _dtype(dtype_name)
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        out[name] = flat_u8[offset:offset + nbytes].clone().view(dtype).reshape(shape)
        offset += nbytes
    return out


def gather_parts(tensors: dict[str, torch.Tensor] | None, meta: Any = None,
                 group: dist.ProcessGroup | None = None) -> list[tuple[Any, dict]]:
    """Collective over `group` (default the world): the (meta, tensors) of every rank that passed tensors, in
    rank order.

    `meta` is plain JSON data; tensors live on the host and come back on the host."""
    headers = all_gather_json(None if tensors is None else {"meta": meta, "tensors": _describe(tensors)},
                              group=group)
    device = collective_device(group)
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    parts = []
    for src, header in zip(ranks, headers):
        if header is None:
            continue
        if src == rank:
            assert tensors is not None
            parts.append((meta, tensors))
            dist.broadcast(_pack(tensors).to(device), src=src, group=group)
            continue
        nbytes = sum(_dtype(d).itemsize * int(torch.Size(shape).numel()) for _, shape, d in header["tensors"])
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=src, group=group)
        parts.append((header["meta"], _unpack(header["tensors"], flat.cpu())))
    return parts


def _batch_tensors(batch: RolloutBatch) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A batch as (tensor fields, plain fields); None fields are plain."""
    tensors, plain = {}, {}
    for field in dataclasses.fields(RolloutBatch):
        value = getattr(batch, field.name)
        if isinstance(value, torch.Tensor):
            tensors[field.name] = value
        else:
            plain[field.name] = value
    return tensors, plain


def gather_global_batch(local: RolloutBatch | None, num_prompts: int, layout: ParallelLayout,
                        group: dist.ProcessGroup | None = None) -> RolloutBatch:
    """Collective over `group` (default the world; it holds `layout`'s ranks): each replica's contributor sends
    its batch; all ranks of the group get them concatenated in dp order."""
    rank = dist.get_rank()
    if dist.get_world_size(group) == 1:
        assert local is not None and layout.dp == 1
        return local
    if is_contributor(layout, rank):
        assert local is not None
        tensors, plain = _batch_tensors(local)
        parts = gather_parts(tensors, {"num_prompts": num_prompts, "plain": plain}, group)
    else:
        parts = gather_parts(None, group=group)
    assert len(parts) == layout.dp, (len(parts), layout)
    batches = [RolloutBatch(**meta["plain"], **tensors) for meta, tensors in parts]
    return concat_batches(batches, [meta["num_prompts"] for meta, _ in parts])


def gather_rows(local_b: torch.Tensor | None, layout: ParallelLayout,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Collective over `group` (default the world; it holds `layout`'s ranks): the contributors' row shards (dp
    order) concatenated on every rank of it."""
    rank = dist.get_rank()
    if dist.get_world_size(group) == 1:
        assert local_b is not None and layout.dp == 1
        return local_b
    mine = {"rows": local_b} if is_contributor(layout, rank) else None
    parts = gather_parts(mine, group=group)
    assert len(parts) == layout.dp, (len(parts), layout)
    return torch.cat([tensors["rows"] for _, tensors in parts])

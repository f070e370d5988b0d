"""Moving per-sample data between role meshes: every rank ends up with the global batch, each role works on its
DP shard, and the shard results are gathered back so the next stage (on any mesh) sees the whole batch.

One rank per replica contributes (tp_rank 0, last pipeline stage) so nothing is counted twice. This works the
same for colocated and split placements; it moves per-sample tensors (tokens, logprobs), never weights.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rlhf.dist.layout import ParallelLayout
from rlhf.trainer.batch import TrainBatch


def is_contributor(layout: ParallelLayout, rank: int) -> bool:
    """The rank that speaks for its replica: tp_rank 0 on the last pipeline stage."""
    if not layout.contains(rank):
        return False
    coords = layout.coords(rank)
    return coords.tp_rank == 0 and coords.pp_rank == layout.pp - 1


def _pad_to(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    if tensor.shape[1] == width:
        return tensor
    pad = torch.full((tensor.shape[0], width - tensor.shape[1], *tensor.shape[2:]), value, dtype=tensor.dtype)
    return torch.cat([tensor, pad], dim=1)


def concat_batches(batches: list[TrainBatch], prompts_per_batch: list[int]) -> TrainBatch:
    """Stack batches row-wise, padding sequence/response widths; group indices become global."""
    seq_width = max(b.tokens_bs.shape[1] for b in batches)
    resp_width = max(b.response_width for b in batches)
    offsets = torch.tensor([0] + prompts_per_batch[:-1]).cumsum(0).tolist()
    merged = {}
    for field in dataclasses.fields(TrainBatch):
        values = [getattr(b, field.name) for b in batches]
        if not isinstance(values[0], torch.Tensor):
            continue
        if field.name == "tokens_bs":
            values = [_pad_to(v, seq_width, batches[0].pad_token_id) for v in values]
        elif field.name.endswith("_bt"):
            values = [_pad_to(v, resp_width, False if v.dtype == torch.bool else 0) for v in values]
        elif field.name == "group_index_b":
            values = [v + offset for v, offset in zip(values, offsets)]
        merged[field.name] = torch.cat(values)
    return dataclasses.replace(batches[0], **merged)


def gather_global_batch(local: TrainBatch | None, num_prompts: int, layout: ParallelLayout) -> TrainBatch:
    """Collective over the world: each replica's contributor sends its batch; all ranks get them concatenated
    in dp order."""
    rank = dist.get_rank()
    if dist.get_world_size() == 1:
        assert local is not None and layout.dp == 1
        return local
    mine = (local, num_prompts) if is_contributor(layout, rank) else None
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    parts = [part for part in everyone if part is not None]
    assert len(parts) == layout.dp, (len(parts), layout)
    return concat_batches([p[0] for p in parts], [p[1] for p in parts])


def gather_rows(local_b: torch.Tensor | None, layout: ParallelLayout) -> torch.Tensor:
    """Collective over the world: the contributors' row shards (dp order) concatenated on every rank."""
    rank = dist.get_rank()
    if dist.get_world_size() == 1:
        assert local_b is not None and layout.dp == 1
        return local_b
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local_b if is_contributor(layout, rank) else None)
    parts = [part for part in everyone if part is not None]
    assert len(parts) == layout.dp, (len(parts), layout)
    return torch.cat(parts)

"""How a role cuts its rows: DP shards balanced by tokens, then either rows sorted by length in micro-batches cut
to their own longest row (compute scales with each micro-batch's length, not the step's), widths evened out
with the expert-parallel peers at ep > 1; or rows bin-packed by a token budget into packed (THD) micro-batches
(`pack_plan`, `packed_micro_batches`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlhf.errors import ConfigError
from rlhf.models.packing import PackedMicroBatch, pack, packed_length
from rlhf.platform import current_device, gemm
from rlhf.stages.batch import SequenceBatch


def balanced_order(lengths_b: torch.Tensor, parts: int) -> torch.Tensor:
    """A row order whose `parts` contiguous equal shards carry near-equal token totals, so no DP rank waits on
    another (verl's balance_batch): longest rows first, each to the lightest shard with room. Deterministic:
    every rank computes the same order from the same lengths."""
    size = lengths_b.shape[0]
    if parts == 1 or size % parts:
        return torch.arange(size)
    per = size // parts
    lengths = lengths_b.tolist()
    shards: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for row in sorted(range(size), key=lambda r: (-lengths[r], r)):
        target = min((k for k in range(parts) if len(shards[k]) < per), key=lambda k: (totals[k], k))
        shards[target].append(row)
        totals[target] += lengths[row]
    return torch.tensor([row for shard in shards for row in sorted(shard)])


def row_lengths(batch: SequenceBatch) -> torch.Tensor:
    """Prompt + response tokens of every row."""
    return batch.prompt_lengths_b + batch.response_lengths_b


def by_length(batch: SequenceBatch) -> torch.Tensor:
    """Row order by sequence length (stable), so micro-batches of neighbouring rows need little padding."""
    return torch.argsort(row_lengths(batch), stable=True)


def common_widths(micro: list[SequenceBatch], ep_group: Any) -> list[SequenceBatch]:
    """Micro-batches padded (right, with pad tokens) to the widest of their expert-parallel peers' at the same
    index: megatron's token dispatchers exchange equal-shaped token blocks between the ranks sharing experts."""
    widths = torch.tensor([mb.tokens_bs.shape[1] for mb in micro], dtype=torch.int64, device=current_device())
    torch.distributed.all_reduce(widths, op=torch.distributed.ReduceOp.MAX, group=ep_group)
    return [dataclasses.replace(mb, tokens_bs=torch.nn.functional.pad(
        mb.tokens_bs, (0, width - mb.tokens_bs.shape[1]), value=mb.pad_token_id)) for mb, width in
        zip(micro, widths.tolist())]


def micro_batches(shard: SequenceBatch, size: int, pgs: Any, *, ragged: bool = False) -> list[SequenceBatch]:
    """`shard` in micro-batches of `size` rows, each cut to its own longest row (callers sort rows by length
    first so similar lengths share a micro-batch); with pp > 1 (`pgs.pp`) the schedule needs one shape, so the
    shard's, and equal micro-batches: a `ragged` split (forward only) then takes the largest size <= `size` that
    divides the shard. At ep > 1 (`pgs.ep`) widths are evened out with the expert-parallel peers."""
    if pgs.pp.size() > 1:
        if ragged:
            size = max(d for d in range(1, size + 1) if shard.size % d == 0)
        micro = shard.trimmed().chunks(size)
    else:
        micro = [micro.trimmed() for micro in shard.chunks(size, ragged=ragged)]
    return common_widths(micro, pgs.ep) if pgs.ep.size() > 1 else micro


def token_bins(lengths: list[int], budget: int, count: int) -> list[list[int]] | None:
    """`count` bins of row indices, each at most `budget` tokens, balanced by tokens: longest row first, each into
    the lightest bin it fits (rows within a bin ascending); None when some row fits no bin."""
    bins: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        fits = [k for k in range(count) if totals[k] + lengths[row] <= budget]
        if not fits:
            return None
        target = min(fits, key=lambda k: (totals[k], k))
        bins[target].append(row)
        totals[target] += lengths[row]
    return [sorted(rows) for rows in bins]


def pack_plan(lengths_b: torch.Tensor, parts: int, budget: int, key: str) -> list[list[list[int]]]:
    """Per DP shard (`parts` contiguous equal shards of the rows), its rows in bins of at most `budget` tokens,
    as few as fit and as many on every shard (ep peers run micro-batches in step). Deterministic from the
    lengths alone: every rank computes the same plan. `key` names the budget in the error."""
    lengths = lengths_b.tolist()
    if max(lengths) > budget:
        raise ConfigError(f"{key}={budget} is smaller than the longest row ({max(lengths)} tokens: prompt + "
                          f"response); raise {key} to at least {max(lengths)}")
    per = len(lengths) // parts
    shards = [lengths[k * per:(k + 1) * per] for k in range(parts)]
    count = max(-(-sum(shard) // budget) for shard in shards)
    while True:
        plans = [token_bins(shard, budget, count) for shard in shards]
        if all(plan is not None for plan in plans):
            return plans
        count += 1


def schedule_lengths(lengths_per_pack: list[list[int]], cp_size: int, pp_size: int) -> list[int]:
    """The length of each pack (its sequences' lengths given): its own (`packed_length`: at cp > 1 each sequence
    padded to 2·cp), or with pp > 1 the longest pack's for all (the schedule needs one shape; at cp > 1 one local
    length `T / cp` on every cp rank and stage, the difference filled by a filler sequence, a multiple of 2·cp)."""
    lengths = [packed_length(pack_lengths, cp_size) for pack_lengths in lengths_per_pack]
    return [max(lengths)] * len(lengths) if pp_size > 1 else lengths


def packed_micro_batches(shard: SequenceBatch, bins: list[list[int]], pgs: Any,
                         compute_dtype: torch.dtype | None = None, hidden_size: int = 0) -> list[PackedMicroBatch]:
    """The rows of each bin of `shard` packed into one micro-batch, at the `schedule_lengths` (pp > 1: one for
    all), at tp = cp = 1 filled to the row count the platform's GEMMs would pad them to for `compute_dtype` and a
    model of `hidden_size` (`gemm.fill_rows`; None: not), at ep > 1 (`pgs.ep`) filled up to the longest of the
    expert-parallel peers'. At cp > 1 (`pgs.cp`) each cp rank holds its share of every sequence (`packing.pack`)."""
    micro = [shard.select(torch.tensor(rows, dtype=torch.int64)).trimmed() for rows in bins]
    cp_group = pgs.cp if pgs.cp.size() > 1 else None
    lengths = schedule_lengths([row_lengths(rows).tolist() for rows in micro], pgs.cp.size(), pgs.pp.size())
    if compute_dtype is not None and pgs.cp.size() == 1 and pgs.tp.size() == 1:
        lengths = [gemm.fill_rows(length, compute_dtype, shard.tokens_bs.device, hidden_size) for length in lengths]
    if pgs.ep.size() > 1:
        widths = torch.tensor(lengths, dtype=torch.int64, device=current_device())
        torch.distributed.all_reduce(widths, op=torch.distributed.ReduceOp.MAX, group=pgs.ep)
        lengths = widths.tolist()
    return [pack(rows, length=length, cp_group=cp_group) for rows, length in zip(micro, lengths)]

"""Context parallelism: which tokens of a packed micro-batch each cp rank holds, and the two gathers across them.

Every sequence of the pack is padded to a multiple of 2·cp and cut into 2·cp equal chunks; cp rank i holds
chunks i and 2·cp−1−i (causal load balance: early chunks attend to little, late ones to much), the layout
megatron's THD RoPE (`_get_thd_freqs_on_this_cp_rank`) and TE's `thd_get_partitioned_indices` use.

Two gathers, differing in their backward: `gather_keys_values` (attention: each rank's queries read every rank's
K/V, so a shard's gradient is the sum over ranks — all-reduce then slice, as gloo has no reduce-scatter) and
`gather_replicated` (per-token outputs whose loss every cp rank computes identically: the gradient of a shard is
its own slice, no communication).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def padded_length(length: int, cp_size: int) -> int:
    """`length` rounded up to a multiple of 2·cp (every chunk the same size)."""
    multiple = 2 * cp_size
    return -(-length // multiple) * multiple


def local_positions(cu_seqlens_n: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 [T / cp]: the packed positions cp rank `cp_rank` holds, sequence by sequence (chunks i, 2cp−1−i).
    Every sequence length in `cu_seqlens_n` must be a multiple of 2·cp."""
    cu = cu_seqlens_n.to(torch.int64)
    starts_n, stops_n = cu[:-1], cu[1:]
    chunk_n = (stops_n - starts_n) // (2 * cp_size)
    assert bool(((stops_n - starts_n) == chunk_n * 2 * cp_size).all()), "sequences must be padded to 2*cp"
    first_n = starts_n + cp_rank * chunk_n  # chunk i
    second_n = stops_n - (cp_rank + 1) * chunk_n  # chunk 2cp-1-i
    sequence_l = torch.repeat_interleave(torch.arange(len(chunk_n), device=cu.device), 2 * chunk_n)
    offset_l = torch.arange(int(2 * chunk_n.sum()), device=cu.device) - torch.repeat_interleave(
        torch.cumsum(2 * chunk_n, 0) - 2 * chunk_n, 2 * chunk_n)
    in_first_l = offset_l < chunk_n[sequence_l]
    return torch.where(in_first_l, first_n[sequence_l] + offset_l,
                       second_n[sequence_l] + offset_l - chunk_n[sequence_l])


def global_order(cu_seqlens_n: torch.Tensor, cp_size: int) -> torch.Tensor:
    """int64 [T]: index into the rank-ordered gather (rank 0's tokens, then rank 1's, ...) of each packed position."""
    gathered = torch.cat([local_positions(cu_seqlens_n, cp_size, rank) for rank in range(cp_size)])
    return torch.argsort(gathered)


def _all_gather(local_tx: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(local_tx) for _ in range(group.size())]
    dist.all_gather(parts, local_tx.contiguous(), group=group)
    return torch.cat(parts)


class _GatherRows(torch.autograd.Function):
    """All-gather of rows; backward sums the gradient over ranks first (`summed`) or takes it as is (every rank
    repeated the same computation), then keeps this rank's slice."""

    @staticmethod
    def forward(ctx, local_tx: torch.Tensor, group: dist.ProcessGroup, summed: bool) -> torch.Tensor:
        ctx.group, ctx.rows, ctx.summed = group, local_tx.shape[0], summed
        return _all_gather(local_tx, group)

    @staticmethod
    def backward(ctx, grad_gx: torch.Tensor):
        if ctx.summed:
            grad_gx = grad_gx.contiguous()
            dist.all_reduce(grad_gx, group=ctx.group)
        start = ctx.group.rank() * ctx.rows
        return grad_gx[start:start + ctx.rows], None, None


def gather_keys_values(local_tx: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[cp·t, ...] every rank's rows in rank order; backward sums the gradient over ranks (reduce-scatter)."""
    return _GatherRows.apply(local_tx, group, True)


def gather_replicated(local_tx: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[cp·t, ...] every rank's rows in rank order, for a computation every rank repeats identically: backward
    keeps this rank's slice of the (identical) gradient."""
    return _GatherRows.apply(local_tx, group, False)

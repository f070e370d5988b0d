"""Reduce a [B, T] per-token loss to a scalar with GLOBAL token/sequence counts.

Every mode divides by counts of the whole global batch (all micro-batches on all DP ranks), so summing the
per-shard losses gives exactly the full-batch loss; metrics built the same way are "partial sums" too.
The trainer must therefore SUM micro-batch gradients and DP gradients. megatron-core 0.16.1 (2-tuple loss_func,
calculate_per_token_loss=False) divides each micro-batch loss by num_microbatches and DDP averages over DP, so
scale the share by num_microbatches * dp_size before handing it to the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.algo.config import LossAggMode


@dataclass(frozen=True, kw_only=True)
class GlobalCounts:
    """Response tokens and non-empty sequences in the global batch (every micro-batch, every DP rank)."""

    num_tokens: int
    num_seqs: int

    def __post_init__(self) -> None:
        assert self.num_tokens >= 0 and self.num_seqs >= 0, self

    @staticmethod
    def local_tensor(response_mask_bt: Tensor) -> Tensor:
        """[2] int64 (tokens, non-empty sequences) of one shard: sum these over shards, then `from_tensor`."""
        mask = response_mask_bt.bool()
        return torch.stack([mask.sum(), mask.any(dim=-1).sum()]).to(torch.int64)

    @classmethod
    def from_tensor(cls, counts_2: Tensor) -> GlobalCounts:
        return cls(num_tokens=int(counts_2[0]), num_seqs=int(counts_2[1]))

    @classmethod
    def of(cls, response_mask_bt: Tensor, group: dist.ProcessGroup | None = None) -> GlobalCounts:
        """Counts of `response_mask_bt` (this rank's whole step batch) summed over `group` if given."""
        counts = cls.local_tensor(response_mask_bt)
        if group is not None:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        return cls.from_tensor(counts)


def aggregate_loss(loss_bt: Tensor, response_mask_bt: Tensor, *, mode: LossAggMode, counts: GlobalCounts,
                   norm_length: int | None = None) -> Tensor:
    """This shard's share of the global-batch loss; masked tokens never contribute (even if NaN)."""
    mask = response_mask_bt.bool()
    masked_bt = torch.where(mask, loss_bt, torch.zeros_like(loss_bt))
    if mode is LossAggMode.TOKEN_MEAN:
        return masked_bt.sum() / max(counts.num_tokens, 1)
    if mode is LossAggMode.TOKEN_SUM:
        return masked_bt.sum()
    seq_sum_b = masked_bt.sum(dim=-1)
    if mode is LossAggMode.SEQ_MEAN_TOKEN_SUM:
        per_seq_b = seq_sum_b
    elif mode is LossAggMode.SEQ_MEAN_TOKEN_MEAN:
        per_seq_b = seq_sum_b / mask.sum(dim=-1).clamp(min=1)
    elif mode is LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        assert norm_length is not None and norm_length >= 1, "validated by parse_agg_mode"
        per_seq_b = seq_sum_b / norm_length
    else:
        raise AssertionError(f"unhandled aggregation mode {mode}")
    return per_seq_b.sum() / max(counts.num_seqs, 1)

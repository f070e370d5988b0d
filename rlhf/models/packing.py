"""Packed (THD) micro-batches: the sequences of right-padded rows laid end to end in one `[1, T]` row, with
positions restarting per sequence and `cu_seqlens` marking the boundaries attention never crosses.

`PackedMicroBatch.unpack` puts a model output back into the rows' `[b, s, ...]` layout (zeros on padding), so
every loss reads a packed forward exactly as a padded one. A pack may end in filler tokens (a sequence of their
own, `padding_mask_bs` True) to reach a length every pipeline stage or expert-parallel peer shares (at cp > 1
a multiple of 2·cp, so it splits into chunks as any sequence and every cp rank holds an equal share).

Context parallelism (`rlhf.platform.context_parallel`): every sequence is padded at its end to a multiple of
2·cp (causal, so its real tokens never see the padding) and each cp rank holds `local_index_l`; the model reads
the local `tokens_bs` / `position_ids_bs`, and `gather_cp` puts per-token outputs back in pack order to `unpack`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf.models.routing_replay import UNKNOWN
from rlhf.platform.context_parallel import gather_replicated, global_order, local_positions, padded_length


@dataclass(frozen=True, kw_only=True)
class PackedMicroBatch:
    """`rows` (a right-padded SequenceBatch) packed into `tokens_1t`; `source_bs[b, s]` is the packed index of
    row b's position s, or T (the zero row `unpack` appends) on padding."""

    rows: Any
    tokens_1t: torch.Tensor
    position_ids_1t: torch.Tensor
    cu_seqlens_n: torch.Tensor  # int32 [sequences (+ filler) + 1]
    max_seqlen: int
    source_bs: torch.Tensor
    padding_mask_1t: torch.Tensor  # True on filler and on the cp padding of each sequence
    local_index_l: torch.Tensor | None = None  # cp > 1: the packed positions this cp rank holds

    def _local(self, tensor_1t: torch.Tensor) -> torch.Tensor:
        return tensor_1t if self.local_index_l is None else tensor_1t[:, self.local_index_l]

    @property
    def tokens_bs(self) -> torch.Tensor:
        """The model's input `[1, T]` (this cp rank's `[1, T / cp]`; what pipeline shapes and router counts read)."""
        return self._local(self.tokens_1t)

    @property
    def position_ids_bs(self) -> torch.Tensor:
        return self._local(self.position_ids_1t)

    @property
    def padding_mask_bs(self) -> torch.Tensor:
        return self._local(self.padding_mask_1t)

    @property
    def labels_bs(self) -> torch.Tensor:
        """The token each (local) position predicts; read only where a sequence goes on. With the rows'
        `extra_labels_bsk` (distillation's teacher top-K ids) `[1, T, 1 + K]`: those ids beside it, moved to the
        packed positions as the tokens are."""
        next_1t = torch.roll(self.tokens_1t, shifts=-1, dims=1)
        extra_bsk = getattr(self.rows, "extra_labels_bsk", None)
        if extra_bsk is None:
            return self._local(next_1t)
        packed_tk = extra_bsk.new_zeros((self.tokens_1t.shape[1] + 1, extra_bsk.shape[-1]))
        packed_tk[self.source_bs.reshape(-1)] = extra_bsk[:, :self.source_bs.shape[1]].reshape(-1, extra_bsk.shape[-1])
        return self._local(torch.cat([next_1t[0, :, None], packed_tk[:-1]], dim=-1)[None])

    @property
    def wanted_bs(self) -> torch.Tensor:
        """True at the (local) positions predicting a real response token of the rows (`rows.response_index`)."""
        rows_n, positions_n = self.rows.response_index()
        wanted = torch.zeros(self.tokens_1t.shape[1] + 1, dtype=torch.bool, device=self.tokens_1t.device)
        wanted[self.source_bs[rows_n, positions_n]] = True
        return self._local(wanted[None, :-1])

    def gather_cp(self, local_1tx: torch.Tensor, cp_group: torch.distributed.ProcessGroup) -> torch.Tensor:
        """A per-token output of this cp rank's positions `[1, T / cp, ...]` -> the whole pack's `[1, T, ...]`
        (identity at cp=1); the loss after it runs identically on every cp rank (`gather_replicated`)."""
        if self.local_index_l is None:
            return local_1tx
        gathered = gather_replicated(local_1tx[0], cp_group)
        return gathered[global_order(self.cu_seqlens_n, cp_group.size()).to(gathered.device)][None]

    @property
    def routed_experts_bslk(self) -> torch.Tensor | None:
        """The rows' replayed experts at the model's input positions `[1, T, L, k]` in pack order (this cp rank's
        `[1, T / cp, L, k]`: a token's experts go where the token goes); filler: UNKNOWN, the router's own choice."""
        routed = getattr(self.rows, "routed_experts_bslk", None)
        if routed is None:
            return None
        width = self.rows.tokens_bs.shape[1]
        if routed.shape[1] < width:
            routed = torch.cat([routed, routed.new_full((routed.shape[0], width - routed.shape[1],
                                                         *routed.shape[2:]), UNKNOWN)], dim=1)
        packed = routed.new_full((self.tokens_1t.shape[1] + 1, *routed.shape[2:]), UNKNOWN)
        packed[self.source_bs.reshape(-1)] = routed[:, :width].reshape(-1, *routed.shape[2:])
        return self._local(packed[:-1].unsqueeze(0))

    def unpack(self, output_1tx: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """A model output `[1, T, ...]` in the rows' layout `[b, s, ...]`, `fill` on padding; differentiable."""
        flat = output_1tx[0]
        extended = torch.cat([flat, flat.new_full((1, *flat.shape[1:]), fill)])
        return extended[self.source_bs]


def packed_length(lengths: list[int], cp_size: int = 1) -> int:
    """Tokens of a pack of sequences this long, before any filler: at cp > 1 each padded to a multiple of 2·cp."""
    return sum(padded_length(n, cp_size) for n in lengths) if cp_size > 1 else sum(lengths)


def pack(rows: Any, *, length: int | None = None,
         cp_group: torch.distributed.ProcessGroup | None = None) -> PackedMicroBatch:
    """The sequences of `rows` (right-padded, `prompt + response` long) end to end, then filler up to `length`
    (`packed_length` or more); with a `cp_group` of size > 1 each sequence padded to a multiple of 2·cp, the
    filler too (so `length` must be one), and this cp rank's share marked."""
    cp_size = 1 if cp_group is None else cp_group.size()
    lengths = (rows.prompt_lengths_b + rows.response_lengths_b).tolist()
    spans = [padded_length(n, cp_size) for n in lengths] if cp_size > 1 else lengths
    total = sum(spans)
    length = total if length is None else length
    assert length >= total and (cp_size == 1 or length % (2 * cp_size) == 0), (length, total, cp_size)
    device = rows.tokens_bs.device
    width = rows.tokens_bs.shape[1]
    valid_bs = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    starts_b = torch.tensor([0, *spans[:-1]], dtype=torch.int64, device=device).cumsum(0)
    source_bs = torch.full((rows.size, width), length, dtype=torch.int64, device=device)
    source_bs[valid_bs] = (starts_b[:, None] + torch.arange(width, device=device)[None, :])[valid_bs]
    tokens = torch.full((length + 1,), rows.pad_token_id, dtype=rows.tokens_bs.dtype, device=device)
    tokens[source_bs[valid_bs]] = rows.tokens_bs[valid_bs]
    seqlens = spans + ([length - total] if length > total else [])
    positions = torch.cat([torch.arange(n, device=device) for n in seqlens])
    cu_seqlens = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    padding = torch.ones(length + 1, dtype=torch.bool, device=device)
    padding[source_bs[valid_bs]] = False
    local = None if cp_size == 1 else local_positions(cu_seqlens, cp_size, cp_group.rank())
    return PackedMicroBatch(rows=rows, tokens_1t=tokens[None, :-1], position_ids_1t=positions[None],
                            cu_seqlens_n=cu_seqlens, max_seqlen=max(seqlens), source_bs=source_bs,
                            padding_mask_1t=padding[None, :-1], local_index_l=local)

"""Packed (THD) micro-batches: the sequences of right-padded rows laid end to end in one `[1, T]` row, with
positions restarting per sequence and `cu_seqlens` marking the boundaries attention never crosses.

`PackedMicroBatch.unpack` puts a model output back into the rows' `[b, s, ...]` layout (zeros on padding), so
every loss reads a packed forward exactly as a padded one. A pack may end in filler tokens (a sequence of their
own, `padding_mask_bs` True) to reach a length every pipeline stage or expert-parallel peer shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf.models.routing_replay import UNKNOWN


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
    padding_mask_1t: torch.Tensor  # True on filler

    @property
    def tokens_bs(self) -> torch.Tensor:
        """The model's input shape `[1, T]` (what pipeline shapes and router token counts read)."""
        return self.tokens_1t

    @property
    def padding_mask_bs(self) -> torch.Tensor:
        return self.padding_mask_1t

    @property
    def routed_experts_bslk(self) -> torch.Tensor | None:
        """The rows' replayed experts in pack order `[1, T, L, k]` (filler: UNKNOWN, the router's own choice)."""
        routed = getattr(self.rows, "routed_experts_bslk", None)
        if routed is None:
            return None
        width = self.rows.tokens_bs.shape[1]
        if routed.shape[1] < width:
            routed = torch.cat([routed, routed.new_full((routed.shape[0], width - routed.shape[1],
                                                         *routed.shape[2:]), UNKNOWN)], dim=1)
        packed = routed.new_full((self.tokens_1t.shape[1] + 1, *routed.shape[2:]), UNKNOWN)
        packed[self.source_bs.reshape(-1)] = routed[:, :width].reshape(-1, *routed.shape[2:])
        return packed[:-1].unsqueeze(0)

    def unpack(self, output_1tx: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """A model output `[1, T, ...]` in the rows' layout `[b, s, ...]`, `fill` on padding; differentiable."""
        flat = output_1tx[0]
        extended = torch.cat([flat, flat.new_full((1, *flat.shape[1:]), fill)])
        return extended[self.source_bs]


def pack(rows: Any, *, length: int | None = None) -> PackedMicroBatch:
    """The sequences of `rows` (right-padded, `prompt + response` long) end to end, then filler up to `length`."""
    lengths = (rows.prompt_lengths_b + rows.response_lengths_b).tolist()
    total = sum(lengths)
    length = total if length is None else length
    assert length >= total, (length, total)
    device = rows.tokens_bs.device
    width = rows.tokens_bs.shape[1]
    valid_bs = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    source_bs = torch.full((rows.size, width), length, dtype=torch.int64, device=device)
    source_bs[valid_bs] = torch.arange(total, device=device)
    tokens = torch.full((length,), rows.pad_token_id, dtype=rows.tokens_bs.dtype, device=device)
    tokens[:total] = rows.tokens_bs[valid_bs]
    seqlens = lengths + ([length - total] if length > total else [])
    positions = torch.cat([torch.arange(n, device=device) for n in seqlens])
    cu_seqlens = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    padding = torch.arange(length, device=device) >= total
    return PackedMicroBatch(rows=rows, tokens_1t=tokens[None], position_ids_1t=positions[None],
                            cu_seqlens_n=cu_seqlens, max_seqlen=max(seqlens), source_bs=source_bs,
                            padding_mask_1t=padding[None])

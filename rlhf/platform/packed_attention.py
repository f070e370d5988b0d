"""Attention over packed (THD) micro-batches where Transformer Engine is absent: block-diagonal causal attention
on `cu_seqlens`, so a packed row never attends across a sequence boundary.

megatron's local `DotProductAttention` refuses `packed_seq_params`; `PackedDotProductAttention` takes them and
runs torch's fused scaled_dot_product_attention over blocks of whole sequences: short sequences share one call
under a block-diagonal causal mask (blocks of at most BLOCK_TOKENS, bounding the per-call overhead), a longer
one is a call of its own, so compute never grows with the pack's square. Without `packed_seq_params` it is
megatron's core unchanged. On CUDA with TE, `TEDotProductAttention` takes the same `PackedSeqParams` natively.

Context parallelism (`_forward_packed_cp`, layout in `context_parallel`): each rank's chunks of a sequence attend
to the K/V of every rank's chunks, all-gathered over `packed_seq_params.cp_group` (one collective per layer, K
and V together), under the causal mask at their global positions. Why an all-gather: on gloo a ring's
point-to-point steps have no compute to overlap with (they are slower, not hidden), and all-to-all over heads
would need heads % (tp·cp) == 0 (SmolLM2's 3 KV heads forbid it); the gathered K/V is `[T, kv heads, d]` of
one layer, small next to the activations the sharding saves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from rlhf.platform.context_parallel import gather_keys_values, global_order, local_positions

BLOCK_TOKENS = 512  # sequences share one masked attention call up to this many tokens


def packed_seq_params(cu_seqlens_n: torch.Tensor, max_seqlen: int,
                      cp_group: torch.distributed.ProcessGroup) -> PackedSeqParams:
    """megatron's THD parameters for one packed micro-batch: sequence `i` is tokens `[cu[i], cu[i+1])`."""
    cu_seqlens_n = cu_seqlens_n.to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens_n, cu_seqlens_kv=cu_seqlens_n,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, cp_group=cp_group)


class PackedDotProductAttention(DotProductAttention):
    """megatron's local attention core, block-diagonal over `cu_seqlens` when given packed sequences."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias=None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """Unpacked: `[s, b, np, hn]` in, `[s, b, hp]` out (megatron's). Packed: `[t, np, hn]` in, `[t, hp]` out."""
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        assert packed_seq_params.qkv_format == "thd" and attention_bias is None, packed_seq_params
        cp_group = packed_seq_params.cp_group
        if cp_group is not None and cp_group.size() > 1:
            return self._forward_packed_cp(query, key, value, packed_seq_params.cu_seqlens_q, cp_group)
        return self._forward_packed(query, key, value, packed_seq_params.cu_seqlens_q)

    def _forward_packed_cp(self, query_lnd: torch.Tensor, key_lnd: torch.Tensor, value_lnd: torch.Tensor,
                           cu_seqlens_n: torch.Tensor, cp_group: torch.distributed.ProcessGroup) -> torch.Tensor:
        """This cp rank's queries `[T / cp, np, hn]` against the whole pack's keys and values (gathered), causal
        at global positions, in blocks of whole sequences as `_forward_packed`."""
        assert not self.config.attention_dropout and not self.config.apply_query_key_layer_scaling
        cp_size = cp_group.size()
        kv_lnd = torch.cat([key_lnd, value_lnd], dim=-1)
        kv_tnd = gather_keys_values(kv_lnd, cp_group)[global_order(cu_seqlens_n, cp_size).to(kv_lnd.device)]
        key_tnd, value_tnd = kv_tnd.split([key_lnd.shape[-1], value_lnd.shape[-1]], dim=-1)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key_tnd, value_tnd = key_tnd.repeat_interleave(groups, dim=1), value_tnd.repeat_interleave(groups, dim=1)
        position_l = local_positions(cu_seqlens_n, cp_size, cp_group.rank()).to(query_lnd.device)
        cu = cu_seqlens_n.tolist()
        outputs, first = [], 0
        for block in _blocks([stop - start for start, stop in zip(cu[:-1], cu[1:])], BLOCK_TOKENS):
            start, stop = cu[first], cu[first + len(block)]
            local = slice(start // cp_size, stop // cp_size)  # a sequence's local tokens are contiguous
            q = query_lnd[local].transpose(0, 1)
            k, v = key_tnd[start:stop].transpose(0, 1), value_tnd[start:stop].transpose(0, 1)
            mask = _global_causal_mask(cu_seqlens_n[first:first + len(block) + 1], position_l[local])
            outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                          scale=self.softmax_scale).transpose(0, 1))
            first += len(block)
        return torch.cat(outputs).reshape(query_lnd.shape[0], -1)

    def _forward_packed(self, query_tnd: torch.Tensor, key_tnd: torch.Tensor, value_tnd: torch.Tensor,
                        cu_seqlens_n: torch.Tensor) -> torch.Tensor:
        """Fused attention over blocks of whole sequences (megatron's scale; dropout and q/k layer scaling off)."""
        assert not self.config.attention_dropout and not self.config.apply_query_key_layer_scaling
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # grouped-query attention: every query head sees its group's key/value head
            key_tnd, value_tnd = key_tnd.repeat_interleave(groups, dim=1), value_tnd.repeat_interleave(groups, dim=1)
        outputs, start = [], 0
        for block in _blocks((cu_seqlens_n[1:] - cu_seqlens_n[:-1]).tolist(), BLOCK_TOKENS):
            q, k, v = (t[start:start + sum(block)].transpose(0, 1) for t in (query_tnd, key_tnd, value_tnd))
            mask = _block_causal_mask(block, q.device) if len(block) > 1 else None
            outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                          scale=self.softmax_scale).transpose(0, 1))
            start += sum(block)
        return torch.cat(outputs).reshape(query_tnd.shape[0], -1)


def _blocks(lengths: list[int], limit: int) -> list[list[int]]:
    """Consecutive sequence lengths grouped into blocks of at most `limit` tokens (a longer sequence alone)."""
    blocks: list[list[int]] = []
    for length in lengths:
        if blocks and sum(blocks[-1]) + length <= limit:
            blocks[-1].append(length)
        else:
            blocks.append([length])
    return blocks


def _block_causal_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[t, t] True where a token may attend: earlier or same position of its own sequence."""
    sequence_t = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                         torch.tensor(lengths, device=device))
    causal_tt = torch.ones(len(sequence_t), len(sequence_t), dtype=torch.bool, device=device).tril()
    return causal_tt & (sequence_t[:, None] == sequence_t[None, :])


def _global_causal_mask(cu_seqlens_n: torch.Tensor, query_positions_l: torch.Tensor) -> torch.Tensor:
    """[l, t] True where a query (at its packed position) may attend to key `cu[0] + j`: same sequence, not
    later."""
    cu = cu_seqlens_n.to(torch.int64).to(query_positions_l.device)
    key_positions_t = torch.arange(int(cu[0]), int(cu[-1]), device=query_positions_l.device)
    same = (torch.searchsorted(cu, query_positions_l, right=True)[:, None]
            == torch.searchsorted(cu, key_positions_t, right=True)[None, :])
    return same & (key_positions_t[None, :] <= query_positions_l[:, None])

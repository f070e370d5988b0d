"""Attention over packed (THD) micro-batches where Transformer Engine is absent: block-diagonal causal attention
on `cu_seqlens`, so a packed row never attends across a sequence boundary.

megatron's local `DotProductAttention` refuses `packed_seq_params`; `PackedDotProductAttention` takes them and
runs torch's fused causal scaled_dot_product_attention (flash on the CPU) per length bucket: the pack's
sequences, longest first, grouped while padding a shorter one to its group's longest costs little
(`length_buckets`, `BUCKET_WASTE`), each group gathered into one right-padded `[b, L]` batch and the real
tokens' outputs gathered back. Causal attention keeps the right padding out of every real query, no mask is
built, compute never grows with the pack's square, and a pack of short sequences is one or two calls (the
per-sequence overhead is what made packing slower than padded rows on short spreads). Without
`packed_seq_params` it is megatron's core unchanged. On CUDA with TE, `TEDotProductAttention` takes the same
`PackedSeqParams` natively.

Context parallelism (`_forward_packed_cp`, layout in `context_parallel`): each rank's chunks of a sequence attend
to the K/V of every rank's chunks, all-gathered over `packed_seq_params.cp_group` (one collective per layer, K
and V together), under the causal mask at their global positions. Why an all-gather: on gloo a ring's
point-to-point steps have no compute to overlap with (they are slower, not hidden), and all-to-all over heads
would need heads % (tp·cp) == 0 (SmolLM2's 3 KV heads forbid it); the gathered K/V is `[T, kv heads, d]` of
one layer, small next to the activations the sharding saves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from rlhf.platform.context_parallel import gather_keys_values, global_order, local_positions

BLOCK_TOKENS = 512  # cp: sequences share one masked attention call up to this many tokens
BUCKET_WASTE = 64 * 64  # a sequence shares a longer one's call while L² - l² <= this (token²)


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
        """Causal fused attention per length bucket (`length_buckets`): each bucket's sequences gathered into one
        right-padded `[b, L]` batch, one SDPA call, the real tokens scattered back (megatron's scale; dropout and
        q/k layer scaling off). Right padding after a causal sequence never reaches its real queries."""
        assert not self.config.attention_dropout and not self.config.apply_query_key_layer_scaling
        heads, groups = query_tnd.shape[1], key_tnd.shape[1]
        plan = bucket_plan(tuple(cu_seqlens_n.tolist()))
        gather_p, scatter_t = plan.gather_p.to(query_tnd.device), plan.scatter_t.to(query_tnd.device)
        qkv_tnd = torch.cat([query_tnd, key_tnd, value_tnd], dim=1)
        qkv_tnd = torch.cat([qkv_tnd, qkv_tnd.new_zeros(1, *qkv_tnd.shape[1:])])  # row `tokens`: the padding
        outputs = []
        for (rows, width), qkv_pnd in zip(plan.shapes, qkv_tnd[gather_p].split(plan.sizes)):
            q, k, v = qkv_pnd.view(rows, width, *qkv_pnd.shape[1:]).transpose(1, 2).split(
                [heads, groups, groups], dim=1)
            outputs.append(_causal_attention(q, k, v, self.softmax_scale).transpose(1, 2).reshape(rows * width, -1))
        return (torch.cat(outputs) if len(outputs) > 1 else outputs[0])[scatter_t]


def _blocks(lengths: list[int], limit: int) -> list[list[int]]:
    """Consecutive sequence lengths grouped into blocks of at most `limit` tokens (a longer sequence alone)."""
    blocks: list[list[int]] = []
    for length in lengths:
        if blocks and sum(blocks[-1]) + length <= limit:
            blocks[-1].append(length)
        else:
            blocks.append([length])
    return blocks


def length_buckets(lengths: list[int], waste: int = BUCKET_WASTE) -> list[list[int]]:
    """Sequence indices in groups that share one attention call, padded to the group's longest: longest first, a
    sequence joins the current group while padding it costs at most `waste` (token², its L² - l² of causal
    attention) and opens a new one otherwise. Deterministic from the lengths alone."""
    buckets: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if buckets and lengths[buckets[-1][0]] ** 2 - lengths[index] ** 2 <= waste:
            buckets[-1].append(index)
        else:
            buckets.append([index])
    return buckets


@dataclass(frozen=True)
class BucketPlan:
    """How `_forward_packed` lays a pack's tokens out: bucket k is a `shapes[k]` = (rows, width) batch of the
    `sizes[k]` slots that follow in `gather_p` (each slot's packed token, `tokens` on padding); `scatter_t` is
    each packed token's slot."""

    shapes: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    gather_p: torch.Tensor
    scatter_t: torch.Tensor


@functools.lru_cache(maxsize=16)  # one plan per pack, shared by every layer
def bucket_plan(cu_seqlens: tuple[int, ...]) -> BucketPlan:
    """The `BucketPlan` of the pack whose sequence `i` is tokens `[cu[i], cu[i+1])` (`length_buckets`)."""
    tokens = cu_seqlens[-1]
    lengths = [stop - start for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    shapes, gathers = [], []
    for bucket in length_buckets(lengths):
        width = lengths[bucket[0]]
        offsets = torch.arange(width)
        slots = torch.tensor([cu_seqlens[i] for i in bucket])[:, None] + offsets[None, :]
        slots[offsets[None, :] >= torch.tensor([lengths[i] for i in bucket])[:, None]] = tokens
        shapes.append((len(bucket), width))
        gathers.append(slots.reshape(-1))
    gather_p = torch.cat(gathers)
    scatter_t = torch.empty(tokens, dtype=torch.int64)
    real = gather_p < tokens
    scatter_t[gather_p[real]] = torch.nonzero(real).squeeze(1)
    return BucketPlan(shapes=tuple(shapes), sizes=tuple(rows * width for rows, width in shapes),
                      gather_p=gather_p, scatter_t=scatter_t)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's fused causal attention on `[b, heads, s, d]` (grouped-query k/v: fewer heads), fp32 under CPU
    autocast (`fused_attention`'s note: its bf16 CPU kernel is slower)."""
    grouped = q.shape[1] != k.shape[1]
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale,
                                                  enable_gqa=grouped)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=grouped)


def _global_causal_mask(cu_seqlens_n: torch.Tensor, query_positions_l: torch.Tensor) -> torch.Tensor:
    """[l, t] True where a query (at its packed position) may attend to key `cu[0] + j`: same sequence, not
    later."""
    cu = cu_seqlens_n.to(torch.int64).to(query_positions_l.device)
    key_positions_t = torch.arange(int(cu[0]), int(cu[-1]), device=query_positions_l.device)
    same = (torch.searchsorted(cu, query_positions_l, right=True)[:, None]
            == torch.searchsorted(cu, key_positions_t, right=True)[None, :])
    return same & (key_positions_t[None, :] <= query_positions_l[:, None])

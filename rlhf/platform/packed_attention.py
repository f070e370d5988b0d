"""Attention over packed (THD) micro-batches where Transformer Engine is absent: causal attention within each
sequence of `cu_seqlens`, so a packed row never attends across a sequence boundary.

megatron's local `DotProductAttention` refuses `packed_seq_params`; `PackedDotProductAttention` takes them and
runs torch's fused causal scaled_dot_product_attention (flash on the CPU) per length bucket: the pack's
sequences, longest first, grouped while padding a shorter one to its group's longest costs little
(`length_buckets`, `BUCKET_WASTE`), each group gathered into one right-padded `[b, L]` batch and the real
tokens' outputs gathered back. Causal attention keeps the right padding out of every real query, no mask is
built, compute never grows with the pack's square, and a pack of short sequences is one or two calls (the
per-sequence overhead is what made packing slower than padded rows on short spreads). fp32 training on CPU
attends the pack in place instead, in one C pass each way (`packed_causal_kernel`, where it applies). Without
`packed_seq_params` it is megatron's core unchanged. On CUDA with TE, `TEDotProductAttention` takes the same
`PackedSeqParams` natively.

Context parallelism (`_forward_packed_cp`, layout in `context_parallel`): each rank's chunks of a sequence attend to
the K/V of every rank's chunks, all-gathered over `packed_seq_params.cp_group` (one collective per layer, K and V
together). The same bucketing on chunks (`cp_chunk_plan`, `attend_chunks`): a rank holds chunks i and 2cp−1−i of
each sequence, and chunk j (c tokens) attends to its sequence's first (j + 1)·c keys, query t to keys 0..j·c + t;
chunks of similar (queries, keys) share one right-padded flash call under a mask of that offset (top-left causal, no
mask, where every offset is 0) that is a strided view of one line per row (`_offset_causal_mask`), so no square is
formed or kept, pack-wide or per chunk. Why an all-gather: on gloo a ring's point-to-point steps have no compute to
overlap with (they are slower, not hidden), and all-to-all over heads would need heads % (tp·cp) == 0 (SmolLM2's 3
KV heads forbid it); the gathered K/V is `[T, kv heads, d]` of one layer, small next to the activations the sharding
saves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from rlhf.platform.context_parallel import gather_keys_values, global_order
from rlhf.platform.packed_causal_kernel import kernel_applies, packed_causal_attention

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
        at global positions: `attend_chunks` on the rank-ordered gather."""
        assert not self.config.attention_dropout and not self.config.apply_query_key_layer_scaling
        kv_lnd = torch.cat([key_lnd, value_lnd], dim=1)
        kv_gnd = gather_keys_values(kv_lnd, cp_group)  # every rank's rows in rank order
        plan = cp_chunk_plan(tuple(cu_seqlens_n.tolist()), cp_group.size(), cp_group.rank())
        return attend_chunks(query_lnd, kv_gnd, key_lnd.shape[1], plan, self.softmax_scale)

    def _forward_packed(self, query_tnd: torch.Tensor, key_tnd: torch.Tensor, value_tnd: torch.Tensor,
                        cu_seqlens_n: torch.Tensor) -> torch.Tensor:
        """Causal fused attention per length bucket (`length_buckets`): each bucket's sequences gathered into one
        right-padded `[b, L]` batch, one SDPA call, the real tokens scattered back (megatron's scale; dropout and
        q/k layer scaling off). Right padding after a causal sequence never reaches its real queries."""
        assert not self.config.attention_dropout and not self.config.apply_query_key_layer_scaling
        heads, groups = query_tnd.shape[1], key_tnd.shape[1]
        cu_seqlens = tuple(cu_seqlens_n.tolist())
        lengths = tuple(stop - start for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        if kernel_applies(lengths, heads, query_tnd.shape[2], query_tnd.dtype, query_tnd.device):
            return packed_causal_attention(query_tnd, key_tnd, value_tnd, cu_seqlens, self.softmax_scale)
        plan = bucket_plan(cu_seqlens)
        gather_p, scatter_t = plan.gather_p.to(query_tnd.device), plan.scatter_t.to(query_tnd.device)
        qkv_tnd = torch.cat([query_tnd, key_tnd, value_tnd], dim=1)
        qkv_tnd = torch.cat([qkv_tnd, qkv_tnd.new_zeros(1, *qkv_tnd.shape[1:])])  # row `tokens`: the padding
        outputs = []
        for (rows, width), qkv_pnd in zip(plan.shapes, qkv_tnd[gather_p].split(plan.sizes)):
            q, k, v = qkv_pnd.view(rows, width, *qkv_pnd.shape[1:]).transpose(1, 2).split(
                [heads, groups, groups], dim=1)
            outputs.append(_causal_attention(q, k, v, self.softmax_scale).transpose(1, 2).reshape(rows * width, -1))
        return (torch.cat(outputs) if len(outputs) > 1 else outputs[0])[scatter_t]


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


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      offsets_b: torch.Tensor | None = None) -> torch.Tensor:
    """torch's fused attention on `[b, heads, s, d]` (grouped-query k/v: fewer heads), causal (top-left) or, with
    `offsets_b`, offset-causal on queries given last first (`_offset_causal_mask`); fp32 under CPU autocast
    (`fused_attention`'s note: its bf16 CPU kernel is slower)."""
    grouped = q.shape[1] != k.shape[1]
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return _causal_attention(q.float(), k.float(), v.float(), scale, offsets_b)
    mask = None if offsets_b is None else _offset_causal_mask(offsets_b, q.shape[2], k.shape[2], q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=grouped)


def _offset_causal_mask(offsets_b: torch.Tensor, width_q: int, width_k: int, dtype: torch.dtype) -> torch.Tensor:
    """`[b, 1, width_q, width_k]` additive mask (0 / -inf) letting query t see keys 0..offset + t, for queries in
    reverse order (slot s is query width_q - 1 - s): then it depends on s + key alone, so it is a strided view of
    `[b, width_q + width_k - 1]` and SDPA keeps that, not the square, for its backward."""
    diagonal = torch.arange(width_q + width_k - 1, device=offsets_b.device)
    allowed_bi = diagonal[None, :] <= (offsets_b[:, None] + width_q - 1)
    line_bi = torch.zeros(allowed_bi.shape, dtype=dtype, device=offsets_b.device).masked_fill(~allowed_bi, -torch.inf)
    return line_bi.as_strided((len(offsets_b), 1, width_q, width_k), (width_q + width_k - 1, 0, 1, 1))


@dataclass(frozen=True)
class ChunkPlan:
    """How `attend_chunks` lays one cp rank's query chunks out: bucket k is `shapes[k]` = (rows, queries, keys),
    one chunk a row, its query slots in `query_q` (local rows; `T / cp` on padding) and its key slots in `key_k`
    (rows of the rank-ordered K/V gather; `T` on padding) right-padded, `offsets[k]` each row's causal offset (its
    query j attends to keys 0..offset + j); a bucket with an offset lists its query slots last first (its mask is
    then a Toeplitz view, `_offset_causal_mask`); `scatter_l` is each local token's query slot."""

    shapes: tuple[tuple[int, int, int], ...]
    query_q: torch.Tensor
    key_k: torch.Tensor
    offsets: tuple[torch.Tensor, ...]
    scatter_l: torch.Tensor


def chunk_buckets(chunks: list[tuple[int, int]], waste: int = BUCKET_WASTE) -> list[list[int]]:
    """Indices of (queries, keys) chunks in groups that share one call, padded to the group's first: most keys
    first, a chunk joins the current group while it has no more queries than the first and padding it costs at
    most `waste` (queries x keys, the kernel's work under a mask); `length_buckets` for rectangles."""
    buckets: list[list[int]] = []
    for index in sorted(range(len(chunks)), key=lambda i: (-chunks[i][1], -chunks[i][0], i)):
        queries, keys = chunks[index]
        if buckets:
            head_queries, head_keys = chunks[buckets[-1][0]]
            if queries <= head_queries and head_queries * head_keys - queries * keys <= waste:
                buckets[-1].append(index)
                continue
        buckets.append([index])
    return buckets


@functools.lru_cache(maxsize=16)  # one plan per pack and cp rank, shared by every layer
def cp_chunk_plan(cu_seqlens: tuple[int, ...], cp_size: int, cp_rank: int) -> ChunkPlan:
    """The `ChunkPlan` of cp rank `cp_rank` in the pack whose sequence `i` is tokens `[cu[i], cu[i+1])` (each a
    multiple of 2·cp long): its chunks i and 2cp−1−i of every sequence, chunk j (c tokens) attending to the
    sequence's first (j + 1)·c keys at offset j·c."""
    tokens, local_tokens = cu_seqlens[-1], cu_seqlens[-1] // cp_size
    rank_row_t = global_order(torch.tensor(cu_seqlens), cp_size)  # packed position -> row of the gather
    spans = []  # (first local query, queries, first packed key, keys)
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        chunk = (stop - start) // (2 * cp_size)
        for position, index in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
            if chunk:
                spans.append((start // cp_size + position * chunk, chunk, start, (index + 1) * chunk))
    shapes, query_slots, key_slots, offsets = [], [], [], []
    for bucket in chunk_buckets([(queries, keys) for _, queries, _, keys in spans]):
        width_q, width_k = spans[bucket[0]][1], spans[bucket[0]][3]
        first_q, queries, first_k, keys = (torch.tensor(column)[:, None] for column in zip(*(spans[i] for i in bucket)))
        position = torch.arange(width_q)
        if bool((keys != queries).any()):  # offset-causal: queries last first
            position = position.flip(0)
        query = first_q + position[None, :]
        query[position[None, :] >= queries] = local_tokens
        key = rank_row_t[(first_k + torch.arange(width_k)[None, :]).clamp(max=tokens - 1)]
        key[torch.arange(width_k)[None, :] >= keys] = tokens
        shapes.append((len(bucket), width_q, width_k))
        query_slots.append(query.reshape(-1))
        key_slots.append(key.reshape(-1))
        offsets.append((keys - queries).reshape(-1))
    query_q = torch.cat(query_slots)
    scatter_l = torch.empty(local_tokens, dtype=torch.int64)
    real = query_q < local_tokens
    scatter_l[query_q[real]] = torch.nonzero(real).squeeze(1)
    return ChunkPlan(shapes=tuple(shapes), query_q=query_q, key_k=torch.cat(key_slots), offsets=tuple(offsets),
                     scatter_l=scatter_l)


def attend_chunks(query_lnd: torch.Tensor, kv_gnd: torch.Tensor, groups: int, plan: ChunkPlan,
                  scale: float) -> torch.Tensor:
    """`[T / cp, heads · hn]`: each local query chunk of `plan` against its sequence's keys and values in
    `kv_gnd` (`[T, 2 · groups, hn]`, K then V heads, rows in gather order), one fused SDPA call per bucket under
    the offset-causal `_offset_causal_mask` (none where every offset is 0: top-left causal)."""
    heads, dim = query_lnd.shape[1], query_lnd.shape[2]
    query_lnd = torch.cat([query_lnd, query_lnd.new_zeros(1, heads, dim)])  # the padding rows
    kv_gnd = torch.cat([kv_gnd, kv_gnd.new_zeros(1, *kv_gnd.shape[1:])])
    device = query_lnd.device
    query_q, key_k = plan.query_q.to(device), plan.key_k.to(device)
    outputs, first_q, first_k = [], 0, 0
    for (rows, width_q, width_k), offsets in zip(plan.shapes, plan.offsets):
        q = query_lnd[query_q[first_q:first_q + rows * width_q]].view(rows, width_q, heads, dim).transpose(1, 2)
        kv = kv_gnd[key_k[first_k:first_k + rows * width_k]].view(rows, width_k, 2 * groups, dim).transpose(1, 2)
        first_q, first_k = first_q + rows * width_q, first_k + rows * width_k
        k, v = kv.split([groups, groups], dim=1)
        offsets = offsets.to(device) if bool(offsets.any()) else None
        outputs.append(_causal_attention(q, k, v, scale, offsets).transpose(1, 2).reshape(rows * width_q, -1))
    return (torch.cat(outputs) if len(outputs) > 1 else outputs[0])[plan.scatter_l.to(device)]

"""The local attention core with torch's fused scaled_dot_product_attention for unpacked micro-batches too.

megatron's local `DotProductAttention` (what the local spec runs where Transformer Engine is absent) computes
attention as baddbmm -> masked softmax -> bmm through a [b, heads, s, s] scores tensor, with a mask fill, a
softmax and their backwards in between, and copies the context back to [s, b, h]: on a CPU that was as long as
the attention GEMMs themselves (`rlhf profile`'s op table, `benchmarks/bench_engine.py --ops`). torch's fused
kernel (flash attention on CPU and GPU) does the same math without the scores tensor. Packed (THD) micro-batches
keep `PackedDotProductAttention`'s block-diagonal path.

Same semantics as megatron's core: its `softmax_scale`, `attention_mask` True = blocked ([b, 1, sq, sk]), causal
when no mask is given and sq > 1, grouped-query heads sharing their group's key/value head. Dropout, q/k layer
scaling, sliding windows and softmax offsets stay on megatron's path (rlhf's configs use none of them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType

from rlhf.platform.packed_attention import PackedDotProductAttention


# Under CPU bf16 autocast (`optim.autocast`) attention stays fp32: torch's bf16 flash kernel for the CPU was
# 4-7x slower than its fp32 one here (fwd+bwd, [8, 8, 128, 32] and [2, 9, 128, 64], one thread), while the bf16
# GEMMs are many times faster than fp32 (AMX).


class FusedDotProductAttention(PackedDotProductAttention):
    """`PackedDotProductAttention` whose unpacked path is one fused attention call."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        """`[s, b, np, hn]` query and `[s, b, ng, hn]` key/value in, `[s, b, np * hn]` out (megatron's)."""
        if packed_seq_params is not None or attention_bias is not None or not self._fusable():
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        sq, batch, heads, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, hn]
        if heads != k.shape[1]:  # grouped-query attention: every query head sees its group's key/value head
            k, v = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
        causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1
        allowed = None if attention_mask is None else ~attention_mask
        if torch.is_autocast_enabled("cpu"):  # fp32 attention: see the note above the class
            with torch.autocast("cpu", enabled=False):
                context = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed,
                                                         is_causal=causal, scale=self.softmax_scale)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=causal,
                                                     scale=self.softmax_scale)
        return context.permute(2, 0, 1, 3).reshape(sq, batch, -1)

    def _fusable(self) -> bool:
        config = self.config
        return (not config.attention_dropout and not config.apply_query_key_layer_scaling
                and self.scale_mask_softmax.window_size is None and self.softmax_offset is None
                and self.attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding, AttnMaskType.no_mask))

"""The decoder forward of the native engine: prefill (many tokens per sequence) and decode (one per slot).

It computes what megatron-core's GPTModel forward computes for the same parameters (RMSNorm, grouped QKV,
RoPE, causal GQA attention, SwiGLU, tied or untied vocab-parallel output), reading and writing the KV
cache, with the TP all-reduces/all-gathers done on the group passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.rollout.native.kv_cache import KVCache
from rlhf.rollout.native.params import DecoderGeometry, DecoderParams, LayerParams


@dataclass
class Decoder:
    """Parameters + geometry + RoPE tables + TP group: everything a forward step needs."""

    params: DecoderParams
    geometry: DecoderGeometry
    tp_group: dist.ProcessGroup | None
    tp_size: int
    max_seq_len: int

    def __post_init__(self) -> None:
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=self.params.inv_freq.device)
        freqs = torch.outer(positions, self.params.inv_freq.float())
        angles = torch.cat([freqs, freqs], dim=-1)
        dtype = self.params.embedding.dtype
        self.cos_td, self.sin_td = angles.cos().to(dtype), angles.sin().to(dtype)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        geo = self.geometry
        if self.tp_size == 1:
            return F.embedding(tokens, self.params.embedding)
        local = tokens - geo.vocab_start
        outside = (local < 0) | (local >= geo.vocab_shard)
        hidden = F.embedding(local.masked_fill(outside, 0), self.params.embedding)
        return self._all_reduce(hidden.masked_fill(outside[..., None], 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits (padding rows of the vocab dropped) on every TP rank."""
        normed = F.rms_norm(hidden, (hidden.shape[-1],), self.params.final_norm, self.geometry.eps)
        shard = F.linear(normed, self.params.output)
        if self.tp_size > 1:
            parts = [torch.empty_like(shard) for _ in range(self.tp_size)]
            dist.all_gather(parts, shard.contiguous(), group=self.tp_group)
            shard = torch.cat(parts, dim=-1)
        return shard[..., :self.geometry.vocab_size].float()

    def _qkv(self, layer: LayerParams, x: torch.Tensor, positions: torch.Tensor):
        """Megatron's per-group QKV layout [q heads of the group, k, v] -> rotated q, k and v."""
        geo = self.geometry
        mixed = F.linear(x, layer.qkv_weight, layer.qkv_bias)
        heads_per_group = geo.num_heads // geo.num_groups
        mixed = mixed.view(*x.shape[:-1], geo.num_groups, heads_per_group + 2, geo.head_dim)
        q = mixed[..., :heads_per_group, :].reshape(*x.shape[:-1], geo.num_heads, geo.head_dim)
        k, v = mixed[..., heads_per_group, :], mixed[..., heads_per_group + 1, :]
        cos, sin = self.cos_td[positions][..., None, :], self.sin_td[positions][..., None, :]
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _mlp_block(self, layer: LayerParams, hidden: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(hidden, (hidden.shape[-1],), layer.mlp_norm, self.geometry.eps)
        gate, up = F.linear(normed, layer.fc1_weight).chunk(2, dim=-1)
        return hidden + self._all_reduce(F.linear(F.silu(gate) * up, layer.fc2_weight))

    def prefill(self, tokens_pl: torch.Tensor, lengths_p: torch.Tensor, slots_p: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """Right-padded prompts [P, L] into cache slots `slots_p`; returns logits at each last real token."""
        width = tokens_pl.shape[1]
        positions = torch.arange(width, device=tokens_pl.device)
        causal_ll = positions[None, :] <= positions[:, None]
        mask_p1ll = (causal_ll[None] & (positions[None, None, :] < lengths_p[:, None, None]))[:, None]
        hidden = self.embed(tokens_pl)
        for index, layer in enumerate(self.params.layers):
            normed = F.rms_norm(hidden, (hidden.shape[-1],), layer.input_norm, self.geometry.eps)
            q, k, v = (t.transpose(1, 2) for t in self._qkv(layer, normed, positions))
            cache.keys[index][slots_p, :, :width] = k
            cache.values[index][slots_p, :, :width] = v
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_p1ll, enable_gqa=True)
            hidden = hidden + self._all_reduce(F.linear(attn.transpose(1, 2).flatten(2), layer.proj_weight))
            hidden = self._mlp_block(layer, hidden)
        last_ph = hidden[torch.arange(hidden.shape[0]), lengths_p - 1]
        return self.logits(last_ph)

    def decode(self, tokens_s: torch.Tensor, positions_s: torch.Tensor, cache: KVCache,
               logit_slots: torch.Tensor) -> torch.Tensor:
        """One token for each of the first S slots at `positions_s`; logits for `logit_slots` only."""
        num_slots = tokens_s.shape[0]
        span = int(positions_s.max()) + 1
        slot_ids = torch.arange(num_slots, device=tokens_s.device)
        mask_s11l = (torch.arange(span, device=tokens_s.device)[None, :] <= positions_s[:, None])[:, None, None]
        hidden = self.embed(tokens_s)[:, None]
        for index, layer in enumerate(self.params.layers):
            normed = F.rms_norm(hidden, (hidden.shape[-1],), layer.input_norm, self.geometry.eps)
            q, k, v = self._qkv(layer, normed, positions_s[:, None])
            keys, values = cache.keys[index], cache.values[index]
            keys[slot_ids, :, positions_s] = k[:, 0]
            values[slot_ids, :, positions_s] = v[:, 0]
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys[:num_slots, :, :span],
                                                  values[:num_slots, :, :span], attn_mask=mask_s11l,
                                                  enable_gqa=True)
            hidden = hidden + self._all_reduce(F.linear(attn.transpose(1, 2).flatten(2), layer.proj_weight))
            hidden = self._mlp_block(layer, hidden)
        return self.logits(hidden[logit_slots, 0])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin

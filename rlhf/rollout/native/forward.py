"""The decoder forward of the native engine: prefill (many tokens per sequence) and decode (one per slot).

It computes what megatron-core's GPTModel forward computes for the same parameters (RMSNorm, grouped QKV,
per-head q/k RMSNorm where the model has it, RoPE, causal GQA attention, SwiGLU or a routed mixture of
SwiGLU experts, tied or untied vocab-parallel output), reading and writing the KV
cache, with the TP all-reduces/all-gathers done on the group passed in. The linear layers run on weights
prepared once per policy version by the platform door (`rlhf.platform.linear`: oneDNN-packed on CPU), so
`prepare(version)` must run before a forward whenever the weights changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf import platform
from rlhf.platform import huge_pages, packed_causal_kernel
from rlhf.platform.linear import DECODE_GEMM_ROWS, PreparedLinear, PreparedSwiGLU
from rlhf.rollout.native.fused_step import build_fused_step
from rlhf.rollout.native.kv_cache import KVCache
from rlhf.rollout.native.moe import PreparedMoE
from rlhf.rollout.native.prefill_plan import AttentionGroup, PackedForward
from rlhf.rollout.native.params import DecoderGeometry, DecoderParams, LayerParams


@dataclass(frozen=True)
class _PreparedLayer:
    input_norm: torch.Tensor
    qkv: PreparedLinear
    proj: PreparedLinear
    mlp_norm: torch.Tensor
    swiglu: PreparedSwiGLU | None  # None in a routed layer
    fc2: PreparedLinear | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    moe: PreparedMoE | None


def _prepare_layer(layer: LayerParams, pack: bool, batch_hint: int) -> _PreparedLayer:
    dense = layer.moe is None
    return _PreparedLayer(input_norm=layer.input_norm,
                          qkv=PreparedLinear(layer.qkv_weight, layer.qkv_bias, pack=pack, batch_hint=batch_hint),
                          proj=PreparedLinear(layer.proj_weight, pack=pack, batch_hint=batch_hint),
                          mlp_norm=layer.mlp_norm,
                          swiglu=PreparedSwiGLU(layer.fc1_weight, pack=pack, batch_hint=batch_hint) if dense else None,
                          fc2=PreparedLinear(layer.fc2_weight, pack=pack, batch_hint=batch_hint) if dense else None,
                          q_norm=layer.q_norm, k_norm=layer.k_norm,
                          moe=None if dense else PreparedMoE(layer.moe, pack=pack, batch_hint=batch_hint))


@dataclass
class Decoder:
    """Parameters + geometry + RoPE tables + TP group: everything a forward step needs.

    `pack_weights`: let the platform lay weights out for its fastest kernel (a copy of the weights, rebuilt
    by `prepare` when the policy version changes); `batch_hint` is the decode batch that layout targets.
    `fused_kernels`: decode attention (RoPE, cache write, attention) in one platform kernel where there is one, and
    with packed weights the whole decode step of a dense model in one call where the platform has that
    (`fused_step`).
    `max_prefill_tokens`: the most prompt tokens one prefill forward packs (its activation memory).
    """

    params: DecoderParams
    geometry: DecoderGeometry
    tp_group: dist.ProcessGroup | None
    tp_size: int
    max_seq_len: int
    pack_weights: bool = True
    batch_hint: int = 32
    fused_kernels: bool = True
    max_prefill_tokens: int = 8192

    def __post_init__(self) -> None:
        self.layers: tuple[_PreparedLayer, ...] = ()
        self.output: PreparedLinear | None = None
        self.fused_step = None  # the one-call decode step (`fused_step.build_fused_step`), built by `prepare`
        self.prepared_version: int | None = None
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=self.params.inv_freq.device)
        freqs = torch.outer(positions, self.params.inv_freq.float())
        dtype = self.params.embedding.dtype
        self.cos_td = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(dtype)
        # rotate_half(x) * sin == roll(x, d/2) * [-sin, sin]: the sign lives in the table, one op saved
        self.sin_td = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(dtype)
        self.rope_t2d = torch.stack([self.cos_td, self.sin_td], dim=1)  # one gather per decode step
        self._arange = torch.arange(max(self.max_seq_len, self.batch_hint), device=positions.device)
        self._neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=positions.device)
        self._zero = torch.zeros((), dtype=dtype, device=positions.device)
        self.fused_attention = (platform.fused_decode_attention(dtype, positions.device) if self.fused_kernels
                                else None)

    @property
    def routes(self) -> bool:
        """Whether the model has routed (MoE) layers."""
        return any(layer.moe is not None for layer in self.params.layers)

    def prepare(self, version: int) -> None:
        """(Re)build the prepared weights unless they were built at weights `version`."""
        if version == self.prepared_version:
            return
        self.release()
        pack, hint = self.pack_weights, self.batch_hint
        with huge_pages.arena():  # the packed copies side by side on huge pages (`rlhf.platform.huge_pages`)
            self.layers = tuple(_prepare_layer(layer, pack, hint) for layer in self.params.layers)
            self.output = PreparedLinear(self.params.output, pack=pack, batch_hint=hint)
            if self.fused_kernels and pack:
                self.fused_step = build_fused_step(self.params, self.geometry, self.layers, self.output,
                                                   self.rope_t2d, self.tp_size)
        self.prepared_version = version

    def release(self) -> None:
        """Drop the prepared weights (their packed copies); `prepare` rebuilds them."""
        self.layers, self.output, self.fused_step, self.prepared_version = (), None, None, None

    def _residual_linear(self, linear: PreparedLinear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W^T, the partial products summed over TP first (fused into the GEMM at tp=1)."""
        if self.tp_size == 1:
            return linear.add_to(residual, x)
        return residual + self._all_reduce(linear(x))

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the hidden dim: the platform kernel's one pass where there is one, else torch."""
        if self.fused_attention is not None:
            return self.fused_attention.rms_norm(hidden, weight, self.geometry.eps)
        return F.rms_norm(hidden, (hidden.shape[-1],), weight, self.geometry.eps)

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
        normed = self._norm(hidden, self.params.final_norm)
        shard = self.output(normed)
        if self.tp_size > 1:
            parts = [torch.empty_like(shard) for _ in range(self.tp_size)]
            dist.all_gather(parts, shard.contiguous(), group=self.tp_group)
            shard = torch.cat(parts, dim=-1)
        if shard.shape[-1] != self.geometry.vocab_size:
            shard = shard[..., :self.geometry.vocab_size]
        return shard if shard.dtype == torch.float32 else shard.float()

    def _qkv(self, layer: _PreparedLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Megatron's per-group QKV layout [q heads of the group, k, v] -> RoPE'd [..., groups, heads/group + 1, d]
        (the group's q heads, then its k; one pass for both) and v [..., groups, d]."""
        geo = self.geometry
        heads_per_group = geo.num_heads // geo.num_groups
        mixed = layer.qkv(x).view(*x.shape[:-1], geo.num_groups, heads_per_group + 2, geo.head_dim)
        mixed = self._qk_normed(layer, mixed)
        rotated = _rope(mixed[..., :heads_per_group + 1, :], cos, sin)
        return rotated, mixed[..., heads_per_group + 1, :]

    def _qk_normed(self, layer: _PreparedLayer, mixed: torch.Tensor) -> torch.Tensor:
        """[..., groups, heads/group + 2, d] with each q and k head RMS-normed (before RoPE, as megatron does)."""
        if layer.q_norm is None:
            return mixed
        hpg, eps, shape = mixed.shape[-2] - 2, self.geometry.eps, (mixed.shape[-1],)
        q = F.rms_norm(mixed[..., :hpg, :], shape, layer.q_norm, eps)
        k = F.rms_norm(mixed[..., hpg:hpg + 1, :], shape, layer.k_norm, eps)
        return torch.cat([q, k, mixed[..., hpg + 1:, :]], dim=-2)

    def _mlp_block(self, layer: _PreparedLayer, hidden: torch.Tensor,
                   routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        normed = self._norm(hidden, layer.mlp_norm)
        if layer.moe is not None:
            return hidden + self._all_reduce(layer.moe(normed, routing))
        return self._residual_linear(layer.fc2, layer.swiglu(normed), hidden)

    def prefill(self, packed: PackedForward, cache: KVCache, routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One packed forward of prompts (`prefill_plan`) into their cache slots -> logits at each prompt's last
        token [P, V], in `packed.prompts` order. `routing` (a list) gets each routed layer's experts per token
        `[T, k]` (packed order), in layer order."""
        hidden = self.embed(packed.tokens_t)
        in_place = [self._attends_in_place(group, hidden.dtype) for group in packed.groups]  # the same every layer
        for index, layer in enumerate(self.layers):
            normed = self._norm(hidden, layer.input_norm)
            mixed = layer.qkv(normed)
            parts = [self._prefill_attention(index, group, group.padded(mixed), cache, kernel)
                     for group, kernel in zip(packed.groups, in_place)]
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            hidden = self._residual_linear(layer.proj, attn, hidden)
            hidden = self._mlp_block(layer, hidden, routing)
        return self.logits(hidden[packed.last_rows])

    def _attends_in_place(self, group: AttentionGroup, dtype: torch.dtype) -> bool:
        """fp32 on CPU: the group's attention through the kernel library's causal attention in place (as training's
        packed attention: a padded prompt is a sequence of `width` tokens, its padding after every real token)."""
        geo = self.geometry
        return (self.fused_attention is not None and dtype == torch.float32
                and packed_causal_kernel.kernel_applies((group.width,) * group.num_prompts, geo.num_heads,
                                                        geo.head_dim, dtype, self.params.embedding.device))

    def _prefill_attention(self, index: int, group: AttentionGroup, mixed: torch.Tensor, cache: KVCache,
                           in_place: bool) -> torch.Tensor:
        """One attention group's raw QKV, right-padded [p, L, qkv] -> its attention output [tokens, heads * d]
        (packed order), keys and values written to its cache slots at positions 0..L-1.

        RoPE and the cache writes are one platform-kernel pass where there is one (in torch they cost ~10% of a
        bf16 prefill, ~6% of an fp32 one), else torch ops. Causal alone is exact for right-padded prompts: a real
        query never sees a later (padding) key. Padding queries read padding keys, but their outputs are dropped and
        their cache entries never read (decode overwrites position p before attending to it), so no [p, 1, L, L]
        mask is built."""
        geo, layer = self.geometry, self.layers[index]
        heads_per_group, width, prompts = geo.num_heads // geo.num_groups, group.width, group.num_prompts
        mixed = self._qk_normed(layer, mixed.view(*mixed.shape[:2], geo.num_groups, heads_per_group + 2,
                                                  geo.head_dim))
        fused = None
        if self.fused_attention is not None:
            fused = self.fused_attention.prefill_rope(mixed.contiguous(), self.rope_t2d[:width], cache.keys[index],
                                                      cache.values[index], group.slots_p, token_major=in_place)
        if fused is not None and in_place:
            q, k, v = (x.flatten(0, 1) for x in fused)  # [p * L, heads or groups, d]
            attn = packed_causal_kernel.packed_causal_attention(q, k, v, tuple(range(0, (prompts + 1) * width, width)),
                                                               geo.head_dim ** -0.5)
            return group.packed(attn.view(prompts, width, -1))
        if fused is not None:
            q, k, v = fused
        else:
            cos, sin = self.cos_td[:width, None, None, :], self.sin_td[:width, None, None, :]
            rotated = _rope(mixed[..., :heads_per_group + 1, :], cos, sin)
            q = rotated[..., :heads_per_group, :].flatten(2, 3).transpose(1, 2)
            k, v = rotated[..., heads_per_group, :].transpose(1, 2), mixed[..., heads_per_group + 1, :].transpose(1, 2)
            cache.write_prompts(index, group.cache_rows, k, v)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return group.packed(attn.transpose(1, 2).flatten(2))

    def decode(self, tokens_s: torch.Tensor, positions_s: torch.Tensor, context: int, cache: KVCache,
               routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One token for each of the first S slots at `positions_s` -> logits [S, V] (free slots compute too);
        `routing` as in `prefill` (`[S, k]` per routed layer).
        `context` (the caller's Python int, so no device sync) is 1 + the highest position a live slot holds.

        Small models are bound by the number of ops per step: the platform's fused step runs it all in one call
        where it applies (`fused_step`: up to DECODE_GEMM_ROWS slots, the rows its GEMM serves); else, with the
        platform's fused attention kernel, RoPE, the cache write and attention are one call per layer; otherwise
        torch ops (`_torch_attention`).
        """
        geo = self.geometry
        if self.fused_step is not None and tokens_s.shape[0] <= DECODE_GEMM_ROWS:
            logits = self.fused_step(tokens_s, positions_s, cache.keys, cache.values)
            return logits if logits.shape[-1] == geo.vocab_size else logits[:, :geo.vocab_size]
        num_slots, heads_per_group = tokens_s.shape[0], geo.num_heads // geo.num_groups
        cos_sin_s2d = self.rope_t2d[positions_s]
        if self.fused_attention is not None:
            def attend(index: int, normed: torch.Tensor) -> torch.Tensor:
                layer = self.layers[index]
                mixed = layer.qkv(normed).view(num_slots, geo.num_groups, heads_per_group + 2, geo.head_dim)
                mixed = self._qk_normed(layer, mixed)
                return self.fused_attention(mixed, cos_sin_s2d, cache.keys[index], cache.values[index], positions_s,
                                            geo.head_dim ** -0.5)
        else:
            attend = self._torch_attention(positions_s, context, cos_sin_s2d, cache)
        hidden = self.embed(tokens_s)
        for index, layer in enumerate(self.layers):
            normed = self._norm(hidden, layer.input_norm)
            hidden = self._residual_linear(layer.proj, attend(index, normed), hidden)
            hidden = self._mlp_block(layer, hidden, routing)
        return self.logits(hidden)

    def _torch_attention(self, positions_s: torch.Tensor, context: int, cos_sin_s2d: torch.Tensor, cache: KVCache):
        """Decode attention in torch ops, written out (q·K with the mask fused into baddbmm, softmax, ·V per
        slot x query group `b`): for one query token several times faster on CPU than SDPA. The per-step mask
        and RoPE rows are built once and shared by every layer."""
        geo = self.geometry
        num_slots, heads_per_group = positions_s.shape[0], geo.num_heads // geo.num_groups
        batch, scale = num_slots * geo.num_groups, geo.head_dim ** -0.5
        future_bl = self._arange[:context] > positions_s.repeat_interleave(geo.num_groups)[:, None]
        mask_b1l = torch.where(future_bl, self._neg_inf, self._zero)[:, None, :]
        cos, sin = cos_sin_s2d[:, :, None, None, :].unbind(1)
        slot_ids = self._arange[:num_slots]

        def attend(index: int, normed: torch.Tensor) -> torch.Tensor:
            rotated, v = self._qkv(self.layers[index], normed, cos, sin)  # [S, G, hpg + 1, d], [S, G, d]
            cache.keys[index][slot_ids, :, positions_s] = rotated[:, :, heads_per_group]
            cache.values[index][slot_ids, :, positions_s] = v
            q_bhd = rotated[:, :, :heads_per_group].flatten(0, 1)
            keys_bdl = cache.flat_keys[index][:batch, :context].transpose(1, 2)
            scores = torch.baddbmm(mask_b1l, q_bhd, keys_bdl, alpha=scale)
            attn = torch.bmm(torch.softmax(scores, dim=-1), cache.flat_values[index][:batch, :context])
            return attn.view(num_slots, -1)

        return attend


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Megatron/HF non-interleaved RoPE: x * cos + rotate_half(x) * sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)

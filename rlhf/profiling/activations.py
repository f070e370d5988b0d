"""Activation memory of one micro-batch on one rank (`rlhf plan`): the bytes autograd keeps from the forward
for the backward, term by term, for rlhf's megatron decoder (RMSNorm, RoPE, GQA, SwiGLU, fusions off).

Basis: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1) count
`s b h (34 + 5 a s / h)` bytes per layer for a GPT layer in 16-bit: 11 sbh + 5 a s^2 b for attention (LN output,
Q, K, V, the s^2 scores, softmax and dropout, the projection's input), 19 sbh for the GELU MLP, 4 sbh for the
two LayerNorms. Adapted here, per token of a layer, in elements of the activation dtype `d` unless noted:

- no dropout: the masks and the dropout outputs are gone;
- RMSNorm (each of the 2 norms): its input `h` and output `h` (the next linear's input), + an fp32 rstd;
- attention through flash / TE fused attention (the GPU path): q `hq = heads x head_dim`, k and v
  `hkv = kv_heads x head_dim` each (GQA: K/V are never expanded), an fp32 softmax log-sum-exp per head, and
  the output `hq` that the out-projection keeps; no `s^2` term at all;
- RoPE unfused (`apply_rope_fusion=False`): cos and sin for q and for k, `4 x head_dim` per position (rows
  of a padded batch share them);
- Qwen3's per-head q/k RMSNorm: its inputs `hq + hkv`, + fp32 rstd per head;
- SwiGLU unfused (`bias_activation_fusion=False`): the fc1 output `2f`, silu(gate) `f`, the offset linear half
  `f` (megatron's `x_linear + glu_linear_offset` is a new tensor) and their product `f` (fc2's input): `5f`.

So a dense layer keeps `4h + 2hq + 2hkv + 4 head_dim + 5f` elements (+ `hq + hkv` with q/k norm) and
`4 (2 + heads)` fp32 bytes per token. Tensor parallelism divides hq, hkv, f and the heads (h stays whole on
every tp rank); sequence parallelism also divides the h terms. Context parallelism divides the tokens (TE's
ring keeps only the local q, k, v, out and lse; K/V are re-sent in the backward). Recompute: `full` (megatron
uniform, one layer per checkpoint) keeps only each layer's input `h` and rebuilds one layer's activations in
the backward; `selective` recomputes the attention core (drops its lse; on the math path its `s^2`). 1F1B
keeps `pp - stage` micro-batches in flight on a stage (at most the micro-batch count). The heads: fused
(`rlhf.models.lm_head`) keeps the response rows' hidden states and at most one chunk of fp32 logits
`[rows, vocab / tp]`; full logits keep the logits and the fp32 tensors of the logprob and entropy graphs
(`rlhf.models.forward`); the value head keeps its input. MoE layers count `top_k` experts' SwiGLU per token
plus the permuted copies and fp32 router logits (an estimate; the dense terms are checked against autograd).

The CPU path (megatron's local layers; `PackedDotProductAttention` for packed batches, `FusedDotProductAttention`
for padded ones, both SDPA's flash kernel) keeps more, and `cpu_path_extra_bytes` says how much, storage by
storage: the kernel library's fp32 norms (`rlhf.platform.rms_norm`) keep x and rstd as counted, but the k norm's
strided input takes torch's composite norm and its `x * rstd` (`+hkv`); the library's SwiGLU (`rlhf.platform.swiglu`,
dense layers) keeps the fc1 output only, not megatron's `silu(gate)` and `up + 0` (`-2f`); padded:
SDPA's q and, with GQA, K and V expanded to every query head (`+2 (hq - hkv)`), or without GQA V itself, a view
that keeps the fused QKV output whole (as the k norm's input does), per layer SDPA's float copy of the
`[b, 1, s, s]` mask, and one RoPE cos/sin pair for the whole model instead of four tables per layer (packed too);
packed: q, k and v gathered into each length bucket's padded slots (no expansion) and SDPA's output in those slots
besides the out-projection's input (`+hq`), and the pack's two slot maps (int64, shared by every layer).
`tests/profiling/test_activations.py` finds estimate + extra equal to the bytes
autograd saves, to the byte. Not checked (no GPU here): whether TE keeps V as a view of the fused QKV output
too, which would add `hq + hkv` per layer (~6% for Qwen3-8B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf.errors import ConfigError
from rlhf.models.spec import ModelSpec

RECOMPUTE = ("none", "full", "selective")
HEADS = ("fused", "full", "value")
Recompute = Literal["none", "full", "selective"]
Head = Literal["fused", "full", "value"]


def check_recompute(value: str, key: str = "recompute") -> None:
    if value not in RECOMPUTE:
        raise ConfigError(f"{key}={value} is not one of {', '.join(RECOMPUTE)}")


@dataclass(frozen=True, kw_only=True)
class MicroBatchShape:
    """One micro-batch on one rank of a tp x cp x pp layout: `tokens` of the whole micro-batch (before the
    cp split), packed (THD) or, with `padded_rows` b > 0, b padded rows sharing one RoPE table; `head_rows` the
    rows the LM head scores (default: every token), `micro_batches` per pass (caps the 1F1B in-flight count).
    `train`: a backward follows (else a forward-only pass keeps nothing)."""

    tokens: int
    padded_rows: int = 0
    tp: int = 1
    cp: int = 1
    pp: int = 1
    pp_rank: int = 0
    micro_batches: int = 1
    sequence_parallel: bool = False
    recompute: Recompute = "none"
    dtype_bytes: int = 2
    head: Head = "fused"
    head_rows: int | None = None
    head_chunk_bytes: int = 8 << 30
    train: bool = True

    def __post_init__(self) -> None:
        check_recompute(self.recompute)
        if self.head not in HEADS:
            raise ConfigError(f"head={self.head!r} is not one of {', '.join(HEADS)}")
        if self.tokens < 1:
            raise ConfigError(f"tokens per micro-batch={self.tokens} must be >= 1")

    @property
    def local_tokens(self) -> int:
        return -(-self.tokens // self.cp)

    @property
    def in_flight(self) -> int:
        """Micro-batches whose activations a 1F1B stage holds at its peak (1 without a backward)."""
        return min(self.pp - self.pp_rank, self.micro_batches) if self.train else 1


@dataclass(frozen=True, kw_only=True)
class ActivationEstimate:
    """Bytes on one rank: one layer's keep for one micro-batch, this stage's layers x in-flight micro-batches,
    the embedding / final norm / head, and their sum (the activation peak of the pass)."""

    per_layer_bytes: int
    layers: int
    in_flight: int
    layers_bytes: int
    ends_bytes: int
    total_bytes: int


def layer_bytes_per_token(spec: ModelSpec, shape: MicroBatchShape, *, moe_layer: bool = False) -> float:
    """Bytes one layer keeps per local token (flash/TE attention, no recompute), the module docstring's sum."""
    tp, d = shape.tp, shape.dtype_bytes
    hidden = spec.hidden_size / tp if shape.sequence_parallel else spec.hidden_size
    heads, kv_heads = spec.num_heads // tp, spec.num_kv_heads // tp
    q_dim, kv_dim = heads * spec.head_dim, kv_heads * spec.head_dim
    rope = 4 * spec.head_dim / max(1, shape.padded_rows)  # per position: padded rows share the table
    elements = 4 * hidden + 2 * q_dim + 2 * kv_dim + rope
    fp32 = 2 + heads
    if spec.qk_norm:
        elements += q_dim + kv_dim
        fp32 += heads + kv_heads
    if moe_layer:
        moe = spec.moe
        elements += moe.top_k * (spec.hidden_size + 5 * moe.expert_ffn_hidden_size / tp)
        fp32 += moe.num_experts
    else:
        elements += 5 * spec.ffn_hidden_size / tp
    if shape.recompute == "selective":
        fp32 -= heads  # the attention core's lse is rebuilt in the backward
    return elements * d + 4 * fp32


def _stage_layers(spec: ModelSpec, shape: MicroBatchShape) -> list[bool]:
    """Whether each layer of this pipeline stage routes to experts (megatron splits layers evenly)."""
    per_stage = spec.num_layers // shape.pp
    first = shape.pp_rank * per_stage
    routed = spec.moe.moe_layers if spec.moe else (False,) * spec.num_layers
    return list(routed[first:first + per_stage])


def _head_bytes(spec: ModelSpec, shape: MicroBatchShape) -> int:
    """The final norm (its input, rstd) and the head on the last stage, for one micro-batch."""
    tokens, d = shape.local_tokens, shape.dtype_bytes
    rows = -(-(shape.head_rows or shape.tokens) // shape.cp)
    norm = tokens * (spec.hidden_size * d + 4)
    local_vocab = spec.padded_vocab_size(shape.tp) // shape.tp
    if shape.head == "value":
        return norm + tokens * spec.hidden_size * d
    if shape.head == "fused":  # gathered rows' hidden, labels/owned/lse/entropy, one chunk of fp32 logits
        return norm + rows * (spec.hidden_size * d + 17) + min(rows * local_vocab * 4, shape.head_chunk_bytes)
    # full logits: the output layer's input, [tokens, vocab/tp] logits in d, the fp32 exp of the logprob graph
    # and the exp, isinf mask, masked logits and exp of the entropy graph; per token the gather index, the
    # owned mask and three fp32 sums (21 bytes)
    return norm + tokens * (spec.hidden_size * d + local_vocab * (d + 17) + 21)


def activation_bytes(spec: ModelSpec, shape: MicroBatchShape) -> ActivationEstimate:
    """The activation peak of one pass on one rank (see the module docstring for every term)."""
    tokens = shape.local_tokens
    routed = _stage_layers(spec, shape)
    per_layer = [layer_bytes_per_token(spec, shape, moe_layer=moe) * tokens for moe in routed]
    biggest = max(per_layer, default=0.0)
    if not shape.train:  # forward only: nothing kept, one layer's tensors alive at a time (an upper bound)
        layers_bytes, kept = biggest, biggest
    elif shape.recompute == "full":  # each layer's input kept, one layer rebuilt at a time in the backward
        hidden = spec.hidden_size / shape.tp if shape.sequence_parallel else spec.hidden_size
        kept = hidden * shape.dtype_bytes * tokens * len(per_layer)
        layers_bytes = kept * shape.in_flight + biggest
    else:
        kept = sum(per_layer)
        layers_bytes = kept * shape.in_flight
    ends = 0
    if shape.pp_rank == 0:
        ends += 8 * tokens * (shape.in_flight if shape.train else 1)  # token ids the embedding keeps
    if shape.pp_rank == shape.pp - 1:
        ends += _head_bytes(spec, shape)
    return ActivationEstimate(per_layer_bytes=round(biggest), layers=len(per_layer), in_flight=shape.in_flight,
                              layers_bytes=round(layers_bytes), ends_bytes=ends,
                              total_bytes=round(layers_bytes) + ends)


def cpu_path_extra_bytes(spec: ModelSpec, attention_calls: list[int], *, tp: int = 1, dtype_bytes: int = 4,
                         batch: int = 1, padded: bool = False) -> int:
    """What the CPU path (local layers) keeps beyond `activation_bytes` for one micro-batch of a whole model (no
    pp, cp, recompute): `attention_calls` are the token counts of its rows (each of the `batch` rows of a
    `padded` batch) or of the sequences of one pack. A padded batch runs `FusedDotProductAttention`: per layer
    SDPA's float copy of the `[b, 1, s, s]` mask; its output is the out-projection's input (a view, no copy); the
    step's RoPE cos/sin are one `[s, head_dim]` pair for every layer and both q and k (`compat.megatron_host._lean_rope`)
    instead of the flash model's per-layer four. A pack runs `PackedDotProductAttention`: in fp32 where the kernel
    library's attention applies (`packed_causal_kernel`), the flash model's q, k, v, out and lse exactly; otherwise
    its `length_buckets` padded to `slots` tokens in all, which SDPA keeps for q, k, v, out and lse, the output then
    gathered back;
    its RoPE cos/sin are one `[T, head_dim]` pair for the model too (the pack's frequencies gathered once)."""
    tokens = sum(attention_calls) * batch
    heads, kv_heads = spec.num_heads // tp, spec.num_kv_heads // tp
    q_dim, kv_dim = heads * spec.head_dim, kv_heads * spec.head_dim
    grouped = heads > kv_heads
    # The kernel library's norms (`rlhf.platform.rms_norm`) keep x and rstd, as the flash model counts; its SwiGLU
    # (`rlhf.platform.swiglu`, dense layers) keeps only the fc1 output, not megatron's silu(gate) and up + 0.
    swiglu = -2 * (spec.ffn_hidden_size // tp) if spec.moe is None else 0
    if not padded:
        import torch

        from rlhf.platform.packed_attention import length_buckets  # megatron's import only when asked
        from rlhf.platform.packed_causal_kernel import kernel_applies

        # q/k norms: the fused QKV output kept whole (the k norm's input; the q norm's is a contiguous copy the
        # kernel keeps), and the k norm's x * rstd (its strided input takes torch's composite norm)
        per_token = swiglu + (q_dim + 2 * kv_dim if spec.qk_norm else 0)
        rope = (2 - 4 * spec.num_layers) * tokens * spec.head_dim * dtype_bytes
        if dtype_bytes == 4 and kernel_applies(tuple(attention_calls), heads, spec.head_dim, torch.float32,
                                               torch.device("cpu")):
            # the kernel library's attention keeps q, k, v, out and lse as the flash model counts, unpadded
            return spec.num_layers * tokens * per_token * dtype_bytes + rope
        slots = sum(len(bucket) * attention_calls[bucket[0]] for bucket in length_buckets(attention_calls))
        padding = (slots - tokens) * ((q_dim + 2 * kv_dim) * dtype_bytes + 4 * heads)  # its q, k, v and lse
        per_layer = tokens * per_token * dtype_bytes + slots * q_dim * dtype_bytes + padding  # + SDPA's out
        return spec.num_layers * per_layer + rope + 8 * (slots + tokens)
    # SDPA keeps q, and K and V expanded to every query head (GQA) or k and V itself, a view that keeps the fused
    # QKV output whole (as does the k norm's input); the q/k norms keep q's input and k's x * rstd
    cpu = q_dim + (2 * q_dim if grouped else kv_dim) + (q_dim + 2 * kv_dim if not grouped or spec.qk_norm else 0)
    flash = q_dim + 2 * kv_dim
    if spec.qk_norm:
        cpu, flash = cpu + q_dim + kv_dim, flash + q_dim + kv_dim
    elements = swiglu + cpu - flash
    squares = batch * sum(n * n for n in attention_calls)
    per_layer = tokens * elements * dtype_bytes + squares * dtype_bytes
    positions = max(attention_calls)  # the rows' length; the flash model counts 4 tables per layer, here 2 in all
    rope = (2 - 4 * spec.num_layers) * positions * spec.head_dim * dtype_bytes
    return spec.num_layers * per_layer + rope

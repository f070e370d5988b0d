"""Causal attention over a pack's sequences in one C pass forward and one backward, for fp32 training on CPU.

`PackedDotProductAttention` otherwise gathers the pack into right-padded length buckets, runs torch's flash kernel
per bucket and scatters the real tokens back. At the short sequences and small heads of RL batches on CPU that
kernel runs far from the machine's speed (tiny Qwen2, 32 sequences of ~40 tokens, head size 16: 1.7 ms forward +
backward per layer; SmolLM2, 4 x 128 tokens, head size 64: 7.2 ms). The kernel library's
`cpu_packed_attention.c` attends each sequence in place on the packed q, k, v (megatron's strided views of the
fused QKV projection), keeps only the output and each row's log-sum-exp for the backward (as flash attention does;
no padded copies, no index tensors) and recomputes the probabilities there: 0.8 and 2.6 ms on the shapes above.

It is chosen (`kernel_applies`) for CPU tensors in fp32 (bf16 under CPU autocast is attended in fp32, as the torch
path does), a head size that is a multiple of 16, sequences up to `MAX_SEQUENCE` tokens (longer ones leave the
cache between queries; flash's tiling is for them) and, when torch runs several threads, packs small enough that
one core beats them (`MAX_SINGLE_THREAD_WORK`); everything else keeps the bucketed flash path. Same arithmetic in
another order: equal to torch's within fp32 rounding.
"""

from __future__ import annotations

import functools

import torch

MAX_SEQUENCE = 4096
# sum over the pack's sequences of length² x heads x head size above which torch's threaded flash kernel stays
# when torch runs more than one thread (the C kernel uses one core)
MAX_SINGLE_THREAD_WORK = 1 << 26


def kernel_applies(lengths: tuple[int, ...], heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> bool:
    """Whether a pack of sequences of these lengths runs the kernel (given the kernel library builds here)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or head_dim % 16 or not lengths:
        return False
    if dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu"):
        return False
    if max(lengths) > MAX_SEQUENCE:
        return False
    if torch.get_num_threads() > 1 and sum(n * n for n in lengths) * heads * head_dim > MAX_SINGLE_THREAD_WORK:
        return False
    from rlhf.kernels.cpu_packed_attention import load

    return load() is not None


@functools.lru_cache(maxsize=16)  # one per pack, shared by every layer
def _offsets(cu_seqlens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(cu_seqlens, dtype=torch.int64)


class _PackedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float,
                kernel) -> torch.Tensor:
        out, lse = kernel.forward(q, k, v, cu, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu, ctx.scale, ctx.kernel = cu, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = ctx.kernel.backward(q, k, v, out, lse, grad_out, ctx.cu, ctx.scale)
        return grad_q, grad_k, grad_v, None, None, None


def packed_causal_attention(query_tnd: torch.Tensor, key_tnd: torch.Tensor, value_tnd: torch.Tensor,
                            cu_seqlens: tuple[int, ...], scale: float) -> torch.Tensor:
    """`[T, heads · d]`: token t of sequence i (tokens `[cu[i], cu[i+1])`) attending to its sequence's tokens up to
    t; q `[T, heads, d]`, k and v `[T, groups, d]`. Only where `kernel_applies`."""
    assert cu_seqlens[0] == 0 and cu_seqlens[-1] == query_tnd.shape[0], (cu_seqlens[:1], cu_seqlens[-1:])
    from rlhf.kernels.cpu_packed_attention import load

    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return packed_causal_attention(query_tnd.float(), key_tnd.float(), value_tnd.float(), cu_seqlens, scale)
    # a strided view (megatron's value is one of the fused QKV output) is kept as its own copy, not the projection
    query_tnd, key_tnd, value_tnd = (x.contiguous() for x in (query_tnd, key_tnd, value_tnd))
    out = _PackedCausal.apply(query_tnd, key_tnd, value_tnd, _offsets(cu_seqlens), scale, load())
    return out.view(out.shape[0], -1)

"""Rotary embedding for training: one C pass forward and one backward on CPU (`rlhf.kernels.cpu_rope`).

Megatron's unfused RoPE (`_apply_rotary_pos_emb_bshd`, which its THD path calls per packed micro-batch) is ~6 torch
passes forward (chunk, neg, cat, two products, a sum) and as many backward, for each of q and k in every layer;
`compat.megatron_host` routes it here. For fp32 on CPU the kernel reads q (or the key's view into the fused QKV
projection, strided) once and writes the rotated heads, and the backward applies the rotation's adjoint to the
gradient in one pass. Other dtypes and devices, several torch threads on a large input (the kernel is
single-threaded) or a CPU without the kernel library keep the torch formula.
"""

from __future__ import annotations

import torch

# Elements above which torch's threaded ops stay when torch runs more than one thread (the kernel uses one core).
MAX_SINGLE_THREAD_NUMEL = 1 << 21


def _kernel(x: torch.Tensor, cos: torch.Tensor):
    if (x.device.type != "cpu" or x.dtype != torch.float32 or cos.dtype != torch.float32 or x.dim() != 4
            or x.stride(-1) != 1 or x.shape[-1] % 2 != 0 or cos.shape != (x.shape[0], x.shape[-1])):
        return None
    if torch.get_num_threads() > 1 and x.numel() > MAX_SINGLE_THREAD_NUMEL:
        return None
    from rlhf.kernels.cpu_rope import load

    return load()


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.kernel = kernel
        return kernel.apply(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        cos, sin = ctx.saved_tensors
        grad = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        return ctx.kernel.apply(grad, cos, sin, backward=True), None, None, None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [T, B, H, D] (megatron's [s, b, h, d]; a THD pack is [T, 1, H, D]) and
    cos, sin [T, D] (rotate_half(x) = [-x2, x1])."""
    kernel = _kernel(x, cos)
    if kernel is None:
        first, second = torch.chunk(x, 2, dim=-1)
        return (x * cos[:, None, None]) + (torch.cat((-second, first), dim=-1) * sin[:, None, None])
    return _RopeFunction.apply(x, cos.contiguous(), sin.contiguous(), kernel)

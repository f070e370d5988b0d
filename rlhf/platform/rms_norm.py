"""RMSNorm for training: torch's `nn.RMSNorm` whose fp32 CPU forward and backward run as one C pass each.

torch's `rms_norm` is a composite on CPU: ~6 elementwise ops and a reduction forward, ~20 backward, each a full
pass over [rows, hidden] with its own dispatch. On a SmolLM2-135M training step (61 norms, two micro-batches of
256 rows at one thread) they took ~100 ms of ~3.3 s; the kernel library's forward (`rms_norm` in
`cpu_decode_attention.c`, which also returns each row's rstd) and backward (`cpu_rms_norm_backward.c`) do the same
in one pass each. Other dtypes and devices, a non-contiguous input, several torch threads on a large input (the
kernels are single-threaded) or a CPU without the kernel library keep torch's op; same parameters and state-dict
names either way. The arithmetic is torch's formula in another summation order: equal to ~1e-7 relative.
"""

from __future__ import annotations

import torch

# Elements above which torch's threaded op stays when torch runs more than one thread (the kernels use one core).
MAX_SINGLE_THREAD_NUMEL = 1 << 20


def _kernel(x: torch.Tensor, weight: torch.Tensor | None):
    """The kernel library's norm for this call, or None (torch's op)."""
    if (weight is None or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or not x.is_contiguous() or x.dim() < 1 or weight.shape != (x.shape[-1],)):
        return None
    if torch.get_num_threads() > 1 and x.numel() > MAX_SINGLE_THREAD_NUMEL:
        return None
    from rlhf.kernels.cpu_rms_norm import load

    return load()


class _RmsNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, kernel) -> torch.Tensor:
        out, rstd = kernel.forward(x, weight.detach(), eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = ctx.kernel.backward(x, weight.detach(), rstd, grad_out)
        return grad_x, grad_weight if ctx.needs_input_grad[1] else None, None, None


class FusedRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` (last dimension, affine) with the kernel library's fp32 CPU passes; anything else is the
    parent's forward. Megatron's local layers build `torch.nn.RMSNorm`; `use_fused_rms_norms` turns those into this
    class in place (no new parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = None if self.eps is None or len(self.normalized_shape) != 1 else _kernel(x, self.weight)
        if kernel is None:
            return super().forward(x)
        return _RmsNormFunction.apply(x, self.weight, self.eps, kernel)


def use_fused_rms_norms(module: torch.nn.Module) -> int:
    """Every `torch.nn.RMSNorm` under `module` becomes a `FusedRMSNorm` (same object, parameters and state dict;
    a subclass that adds no state, so only its forward changes). Returns how many."""
    count = 0
    for norm in module.modules():
        if type(norm) is torch.nn.RMSNorm:
            norm.__class__ = FusedRMSNorm
            count += 1
    return count

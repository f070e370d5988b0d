"""SwiGLU for training: silu(gate) * up of a fused [gate; up] projection, one C pass forward and backward on CPU.

Megatron's local MLP runs it as chunk + silu + mul forward and ~6 passes and a cat backward. For fp32 on CPU the
kernel library's `rlhf_swiglu_f32` / `rlhf_swiglu_backward_f32` (`cpu_decode_gemm.c`) read the projection once
and write the gradient of the whole [gate; up] output directly. Megatron takes an activation module on the whole
projection when `use_te_activation_func` is set (its MLP's hook for TE's fused activations); `rlhf.models.builder`
sets it, with this module, on dense models' local layers only (MoE experts keep megatron's path). Other dtypes and
devices, non-contiguous input, several torch threads on a large input (the kernels are single-threaded) or a CPU
without the kernel library run megatron's torch formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements above which torch's threaded ops stay when torch runs more than one thread (the kernels use one core).
MAX_SINGLE_THREAD_NUMEL = 1 << 21


def _kernel(x: torch.Tensor):
    if (x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous() or x.dim() < 1
            or x.shape[-1] % 2 != 0):
        return None
    if torch.get_num_threads() > 1 and x.numel() > MAX_SINGLE_THREAD_NUMEL:
        return None
    from rlhf.kernels.cpu_decode_gemm import load

    return load()


class _SwiGluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, kernel) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        ctx.kernel = kernel
        return kernel.swiglu(gate_up)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        return ctx.kernel.swiglu_backward(gate_up, grad_out), None


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate; up] on the last dimension."""
    kernel = _kernel(gate_up)
    if kernel is None:
        gate, up = torch.chunk(gate_up, 2, dim=-1)
        return F.silu(gate) * up
    return _SwiGluFunction.apply(gate_up, kernel)


class FusedSwiGLU(torch.nn.Module):
    """Megatron MLP's activation module (built with its config) applying `swiglu` to the fc1 output."""

    def __init__(self, config=None) -> None:
        super().__init__()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate_up)

"""The fp32 RMSNorm of training on CPU: the forward (`rlhf_rms_norm_f32`, which also returns each row's rstd) and
its backward (`cpu_rms_norm_backward.c`), in the kernel library's shared object (`cpu_decode_attention.library`).
`load()` returns None where that cannot be built, and callers keep torch's `rms_norm`."""

from __future__ import annotations

import ctypes
import functools

import torch

from rlhf.kernels.cpu_decode_attention import library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load() -> RmsNorm | None:
    lib = library()
    return None if lib is None else RmsNorm(lib)


class RmsNorm:
    """forward(x [..., d], weight [d], eps) -> (y, rstd [rows]); backward(x, weight, rstd, grad_y) -> (grad_x,
    grad_weight). fp32, contiguous."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._forward, self._backward = lib.rlhf_rms_norm_f32, lib.rlhf_rms_norm_backward_f32
        self._forward.restype, self._backward.restype = None, ctypes.c_int
        self._forward.argtypes = [_PTR, _PTR, _I64, _I64, ctypes.c_float, _PTR, _PTR]
        self._backward.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR]

    def forward(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        assert x.dtype == weight.dtype == torch.float32 and x.is_contiguous() and weight.is_contiguous()
        dim = x.shape[-1]
        assert weight.shape == (dim,)
        out, rstd = torch.empty_like(x), torch.empty(x.numel() // dim)
        self._forward(x.data_ptr(), weight.data_ptr(), rstd.numel(), dim, eps, out.data_ptr(), rstd.data_ptr())
        return out, rstd

    def backward(self, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grad = grad.contiguous()
        assert grad.dtype == torch.float32 and grad.shape == x.shape and rstd.numel() == x.numel() // x.shape[-1]
        grad_x, grad_w = torch.empty_like(x), torch.empty_like(weight)
        if self._backward(x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), grad.data_ptr(), rstd.numel(),
                          x.shape[-1], grad_x.data_ptr(), grad_w.data_ptr()) != 0:
            raise MemoryError(f"RMSNorm backward: no memory for {x.shape[-1]} doubles of scratch")
        return grad_x, grad_w

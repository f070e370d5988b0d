"""Training's fp32 rotary embedding on CPU (`cpu_rope.c`), forward and backward, in the kernel library's shared
object (`cpu_decode_attention.library`); `load()` returns None where that cannot be built."""

from __future__ import annotations

import ctypes
import functools

import torch

from rlhf.kernels.cpu_decode_attention import library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load() -> Rope | None:
    lib = library()
    return None if lib is None else Rope(lib)


class Rope:
    """apply(x [T, B, H, D] (last dim contiguous, any other strides), cos, sin [T, D] contiguous, backward)
    -> contiguous [T, B, H, D]: the rotation (backward=False) or its adjoint, for a gradient (backward=True)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rope = lib.rlhf_rope_f32
        self._rope.restype = None
        self._rope.argtypes = [_PTR, *[_I64] * 7, _PTR, _PTR, ctypes.c_int, _PTR]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
        tokens, batch, heads, dim = x.shape
        assert x.dtype == cos.dtype == sin.dtype == torch.float32 and x.stride(-1) == 1 and dim % 2 == 0
        assert cos.shape == sin.shape == (tokens, dim) and cos.is_contiguous() and sin.is_contiguous()
        out = torch.empty(tokens, batch, heads, dim)
        self._rope(x.data_ptr(), tokens, batch, heads, dim, x.stride(0), x.stride(1), x.stride(2), cos.data_ptr(),
                   sin.data_ptr(), int(backward), out.data_ptr())
        return out

"""Training's causal attention over packed (THD) sequences on CPU, fp32 (`cpu_packed_attention.c`), forward and
backward, in the kernel library's shared object (`cpu_decode_attention.library`). `load()` returns None where that
cannot be built, and callers keep torch's attention."""

from __future__ import annotations

import ctypes
import functools

import torch

from rlhf.kernels.cpu_decode_attention import library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_VIEW = [_PTR, _I64, _I64]  # base, token stride, head stride (elements)


@functools.cache
def load() -> PackedAttention | None:
    lib = library()
    return None if lib is None else PackedAttention(lib)


def _view(x: torch.Tensor) -> tuple[int, int, int]:
    assert x.dtype == torch.float32 and x.dim() == 3 and x.stride(2) == 1, (x.dtype, x.shape, x.stride())
    return x.data_ptr(), x.stride(0), x.stride(1)


class PackedAttention:
    """forward(q [T, heads, d], k, v [T, groups, d], cu [seqs + 1] int64, scale) -> (out [T, heads, d], lse
    [T, heads]); backward(q, k, v, out, lse, grad_out, cu, scale) -> (grad_q, grad_k, grad_v). fp32; q, k, v may be
    strided views with a contiguous last dimension."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._forward, self._backward = lib.rlhf_packed_attention_f32, lib.rlhf_packed_attention_backward_f32
        self._forward.restype = self._backward.restype = ctypes.c_int
        shape = [_PTR, _I64, _I64, _I64, _I64, ctypes.c_float]  # cu, seqs, heads, groups, d, scale
        self._forward.argtypes = [*_VIEW * 3, *shape, _PTR, _PTR]
        self._backward.argtypes = [*_VIEW * 3, _PTR, _PTR, _PTR, *shape, _PTR, _PTR, _PTR]

    @staticmethod
    def _shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> tuple[int, int, int, int]:
        tokens, heads, dim = q.shape
        groups = k.shape[1]
        assert k.shape == v.shape == (tokens, groups, dim) and heads % groups == 0, (q.shape, k.shape, v.shape)
        assert cu.dtype == torch.int64 and cu.is_contiguous() and cu.dim() == 1, cu
        return len(cu) - 1, heads, groups, dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        seqs, heads, groups, dim = self._shape(q, k, v, cu)
        out, lse = q.new_empty(q.shape), q.new_empty(q.shape[:2])
        if self._forward(*_view(q), *_view(k), *_view(v), cu.data_ptr(), seqs, heads, groups, dim, scale,
                         out.data_ptr(), lse.data_ptr()) != 0:
            raise MemoryError(f"packed attention: no memory for the scratch of a {int(cu.diff().max())}-token sequence")
        return out, lse

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor, cu: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seqs, heads, groups, dim = self._shape(q, k, v, cu)
        grad_out = grad_out.contiguous()
        assert out.is_contiguous() and lse.is_contiguous() and grad_out.shape == out.shape == q.shape
        grad_q = q.new_empty(q.shape)
        grad_k, grad_v = k.new_empty(k.shape), v.new_empty(v.shape)
        if self._backward(*_view(q), *_view(k), *_view(v), out.data_ptr(), grad_out.data_ptr(), lse.data_ptr(),
                          cu.data_ptr(), seqs, heads, groups, dim, scale, grad_q.data_ptr(), grad_k.data_ptr(),
                          grad_v.data_ptr()) != 0:
            raise MemoryError(f"packed attention: no memory for the scratch of a {int(cu.diff().max())}-token sequence")
        return grad_q, grad_k, grad_v

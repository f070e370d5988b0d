"""The decode-size fp32 GEMM (`cpu_decode_gemm.c`): pack a weight once, then y = x @ W^T (+ residual) for a few
dozen rows. Built into the same shared object as the decode-attention kernel (`cpu_decode_attention.library`);
`load()` returns None where that cannot be built, and callers keep their torch / oneDNN path."""

from __future__ import annotations

import ctypes
import functools

import torch

from rlhf.kernels.cpu_decode_attention import library

PANEL = 48  # columns per packed panel (NR in the C source)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load() -> DecodeGemm | None:
    """The GEMM, built on first use with the other decode kernels; None where they cannot be built (logged once)."""
    lib = library()
    return None if lib is None else DecodeGemm(lib)


class DecodeGemm:
    """pack(W [n, k] fp32) -> the packed copy; linear(x [..., k], packed, n, residual=None) -> [..., n];
    swiglu(gate_up [..., 2i]) -> silu(gate) * up [..., i]; swiglu_backward(gate_up, grad [..., i]) -> [..., 2i]
    (training's SwiGLU, `rlhf.platform.swiglu`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack, self._linear, self._swiglu = lib.rlhf_pack_linear_f32, lib.rlhf_linear_f32, lib.rlhf_swiglu_f32
        self._swiglu_backward = lib.rlhf_swiglu_backward_f32
        for fn, args in ((self._pack, [_PTR, _I64, _I64, _PTR]),
                         (self._linear, [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR]),
                         (self._swiglu, [_PTR, _I64, _I64, _PTR]),
                         (self._swiglu_backward, [_PTR, _PTR, _I64, _I64, _PTR])):
            fn.restype, fn.argtypes = None, args

    @staticmethod
    def packed_numel(weight: torch.Tensor) -> int:
        n, k = weight.shape
        return -(-n // PANEL) * PANEL * k

    def pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The packed copy, into `out` (fp32, `packed_numel` elements, contiguous) when given."""
        assert weight.dtype == torch.float32 and weight.dim() == 2 and weight.device.type == "cpu"
        weight = weight.detach().contiguous()
        n, k = weight.shape
        packed = torch.empty(self.packed_numel(weight)) if out is None else out
        assert packed.dtype == torch.float32 and packed.is_contiguous() and packed.numel() == self.packed_numel(weight)
        self._pack(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        k = x.shape[-1]
        assert x.dtype == torch.float32 and packed.numel() == -(-n // PANEL) * PANEL * k
        x2 = x.reshape(-1, k).contiguous()
        out = torch.empty(x2.shape[0], n)
        add = None
        if residual is not None:
            assert residual.dtype == torch.float32 and residual.shape == (*x.shape[:-1], n)
            add = residual.reshape(-1, n).contiguous()
        self._linear(x2.data_ptr(), x2.shape[0], k, packed.data_ptr(), n, None if add is None else add.data_ptr(),
                     out.data_ptr())
        return out.view(*x.shape[:-1], n)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        assert gate_up.dtype == torch.float32 and gate_up.shape[-1] % 2 == 0
        inner = gate_up.shape[-1] // 2
        flat = gate_up.reshape(-1, 2 * inner).contiguous()
        out = torch.empty(flat.shape[0], inner)
        self._swiglu(flat.data_ptr(), flat.shape[0], inner, out.data_ptr())
        return out.view(*gate_up.shape[:-1], inner)

    def swiglu_backward(self, gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        assert gate_up.dtype == grad.dtype == torch.float32 and gate_up.is_contiguous()
        inner = gate_up.shape[-1] // 2
        assert grad.shape == (*gate_up.shape[:-1], inner)
        grad = grad.contiguous()
        out = torch.empty_like(gate_up)
        self._swiglu_backward(gate_up.data_ptr(), grad.data_ptr(), grad.numel() // inner, inner, out.data_ptr())
        return out

"""The fused fp32 decode step (`cpu_decode_stack.c`): embedding, every dense layer, final norm and LM head of one
decode step in a single call, on weights packed for the decode GEMM (`cpu_decode_gemm.py`). In the kernel library's
shared object (`cpu_decode_attention.library`); `load()` returns None where that cannot be built."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from rlhf.kernels.cpu_decode_attention import library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class _Layer(ctypes.Structure):
    _fields_ = [(name, _PTR) for name in ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "proj", "mlp_norm",
                                           "fc1", "fc2", "k_cache", "v_cache")]


class _Geometry(ctypes.Structure):
    _fields_ = [*((name, _I64) for name in ("hidden", "groups", "heads", "head_dim", "ffn", "max_len", "vocab")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@dataclass(frozen=True)
class StackLayer:
    """One dense layer: norms [hidden] (q_norm / k_norm [head_dim] or None), GEMM weights packed by
    `DecodeGemm.pack` (qkv [groups * (heads + 2) * head_dim rows], proj [hidden], fc1 [2 * ffn: gate; up], fc2
    [hidden]), qkv_bias or None."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    proj: torch.Tensor
    mlp_norm: torch.Tensor
    fc1: torch.Tensor
    fc2: torch.Tensor


@functools.cache
def load() -> DecodeStackKernel | None:
    lib = library()
    return None if lib is None else DecodeStackKernel(lib)


class DecodeStackKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.step, self.scratch_floats = lib.rlhf_decode_stack_f32, lib.rlhf_decode_stack_scratch
        self.step.restype, self.scratch_floats.restype = None, _I64
        self.step.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, *[_PTR] * 7]
        self.scratch_floats.argtypes = [_PTR, _I64]


class DecodeStack:
    """A model's decode step in one call. Holds references to every tensor whose address it passes (the packed
    weights stay valid while it lives); `__call__` reads and writes the KV cache lists it is given (each layer's
    [cache_slots, groups, max_len, head_dim] fp32, contiguous), re-pointing the layers whenever their addresses
    change, and keeps no reference to them.

    `rope` [positions, 2, head_dim]: cos | signed sin per position (the decode-attention kernel's rows)."""

    def __init__(self, kernel: DecodeStackKernel, layers: list[StackLayer], *, embedding: torch.Tensor,
                 rope: torch.Tensor, final_norm: torch.Tensor, head: torch.Tensor, vocab_rows: int, hidden: int,
                 groups: int, heads: int, head_dim: int, ffn: int, eps: float) -> None:
        self.kernel, self.layers, self.vocab_rows = kernel, layers, vocab_rows
        tensors = (embedding, rope, final_norm, head, *(t for layer in layers for t in vars(layer).values()
                                                      if t is not None))
        assert all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in tensors)
        assert embedding.shape[1] == hidden and rope.shape[1:] == (2, head_dim)
        self.embedding, self.rope, self.final_norm, self.head = embedding, rope, final_norm, head
        self.geometry = _Geometry(hidden=hidden, groups=groups, heads=heads, head_dim=head_dim, ffn=ffn, max_len=0,
                                  vocab=vocab_rows, eps=eps, scale=head_dim ** -0.5)
        self.structs = (_Layer * len(layers))()
        for struct, layer in zip(self.structs, layers):
            for name, tensor in vars(layer).items():
                setattr(struct, name, None if tensor is None else tensor.data_ptr())
        self._structs_at, self._geometry_at = ctypes.addressof(self.structs), ctypes.addressof(self.geometry)
        self.hidden, self.scratch = torch.empty(0), torch.empty(0)  # sized by _bind
        self.bound: tuple | None = None  # the cache's addresses and shape (no references: a released cache frees)

    @staticmethod
    def _cache_key(keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple:
        return (tuple(keys[0].shape), *(t.data_ptr() for t in keys), *(t.data_ptr() for t in values))

    def _bind(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Point every layer at its cache tensors [cache_slots, ...] and size the buffers for them (once per
        cache)."""
        assert len(keys) == len(values) == len(self.structs)
        for struct, k, v in zip(self.structs, keys, values):
            assert k.dtype == v.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()
            assert k.shape == v.shape and k.shape[1:] == (self.geometry.groups, keys[0].shape[2],
                                                          self.geometry.head_dim)
            struct.k_cache, struct.v_cache = k.data_ptr(), v.data_ptr()
        assert self.rope.shape[0] >= keys[0].shape[2], "a RoPE row for every cache position"
        cache_slots, self.geometry.max_len = keys[0].shape[0], keys[0].shape[2]
        self.hidden = torch.empty(cache_slots, self.geometry.hidden)
        self.scratch = torch.empty(self.kernel.scratch_floats(self._geometry_at, cache_slots))
        self.bound = self._cache_key(keys, values)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> torch.Tensor:
        """tokens, positions [S] int64 (S at most the cache's slots; positions below its length) -> logits
        [S, vocab_rows]; each slot's key and value written at its position of cache row s."""
        if self.bound != self._cache_key(keys, values):
            self._bind(keys, values)
        slots = tokens.shape[0]
        assert slots <= self.hidden.shape[0] and positions.shape == (slots,)
        assert tokens.dtype == positions.dtype == torch.int64 and tokens.is_contiguous() and positions.is_contiguous()
        logits = torch.empty(slots, self.vocab_rows)
        self.kernel.step(self._structs_at, len(self.structs), self._geometry_at, tokens.data_ptr(),
                         positions.data_ptr(), slots, self.embedding.data_ptr(), self.rope.data_ptr(),
                         self.final_norm.data_ptr(), self.head.data_ptr(), self.hidden.data_ptr(),
                         logits.data_ptr(), self.scratch.data_ptr())
        return logits

"""The native sampler's fp32 draw on CPU (`cpu_sample.c`), in the kernel library's shared object
(`cpu_decode_attention.library`); `load()` returns None where that cannot be built."""

from __future__ import annotations

import ctypes
import functools

import torch

from rlhf.kernels.cpu_decode_attention import library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
BLOCK = 256  # tokens per block of the two-level draw (`cpu_sample.c`)


@functools.cache
def load() -> Sample | None:
    lib = library()
    return None if lib is None else Sample(lib)


class Sample:
    """draw(logits [K, V] fp32 contiguous, inv_temperature, uniform [K] fp32) -> (tokens [K] long, log_softmax(logits)
    at them, log_softmax(logits * inv_temperature) at them)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._sample = lib.rlhf_sample_f32
        self._sample.restype = None
        self._sample.argtypes = [_PTR, _I64, _I64, ctypes.c_float, _PTR, _PTR, _PTR, _PTR, _PTR]

    def draw(self, logits_kv: torch.Tensor, inv_temperature: float,
             uniform_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, vocab = logits_kv.shape
        assert logits_kv.dtype == uniform_k.dtype == torch.float32 and logits_kv.is_contiguous()
        assert uniform_k.is_contiguous() and uniform_k.numel() == rows and inv_temperature > 0
        scratch = torch.empty(-(-vocab // BLOCK))
        tokens_k, logprobs_k, scaled_k = torch.empty(rows, dtype=torch.long), torch.empty(rows), torch.empty(rows)
        self._sample(logits_kv.data_ptr(), rows, vocab, inv_temperature, uniform_k.data_ptr(), scratch.data_ptr(),
                     tokens_k.data_ptr(), logprobs_k.data_ptr(), scaled_k.data_ptr())
        return tokens_k, logprobs_k, scaled_k

"""The fused CPU decode-attention kernel (`cpu_decode_attention.c`): build once per machine, load, call.

A decode step of a small model is bound by the number of ops, and attention is the largest group of them
(RoPE, two cache writes, a masked batched GEMM, softmax, another batched GEMM per layer). The kernel does all
of it in one call per layer and visits only each slot's own positions. `load()` returns None when no C compiler is
available or the build fails (the reason is logged once); callers then use their torch path.

The shared object is compiled (for this CPU: -march=native) into `$RLHF_CACHE_DIR` (default ~/.cache/rlhf)/
kernels/<hash of source, flags and CPU>/ and renamed into place, so ranks building at the same time never load
a half-written file and a home folder shared by different CPUs never serves one the other's build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# One shared object for the CPU kernels: this attention kernel (with the fp32/bf16 RMSNorm and prefill RoPE), the
# decode-size fp32 GEMM (`cpu_decode_gemm.py`), the whole fp32 decode step built from both (`cpu_decode_stack.py`),
# the RMSNorm backward of training (`cpu_rms_norm.py`), training's packed causal attention
# (`cpu_packed_attention.py`), its rotary embedding (`cpu_rope.py`) and the native sampler's draw (`cpu_sample.py`).
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_decode_attention.c", "cpu_decode_gemm.c", "cpu_decode_stack.c",
                             "cpu_rms_norm_backward.c", "cpu_packed_attention.c", "cpu_rope.c",
                             "cpu_sample.c"))
# -ffast-math (vectorised expf from libmvec, reassociated dot products) at compile time only: linking with it
# would add crtfastmath.o, which turns on flush-to-zero for the whole process.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-lmvec", "-lm")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _cpu_signature() -> str:
    """Architecture plus the CPU's feature flags (Linux), which -march=native compiles for."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _cache_dir() -> Path:
    root = Path(os.environ.get("RLHF_CACHE_DIR", Path.home() / ".cache" / "rlhf"))
    key = (b"".join(source.read_bytes() for source in SOURCES) + " ".join(COMPILE_FLAGS + LINK_FLAGS).encode()
           + _cpu_signature().encode())
    return root / "kernels" / hashlib.sha256(key).hexdigest()[:16]


def _build(target: Path) -> None:
    name = os.environ.get("CC", "gcc")
    compiler = shutil.which(name)
    if compiler is None:
        raise RuntimeError(f"no C compiler {name!r} on PATH (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects, lib = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES], Path(tmp) / target.name
        compiles = [[compiler, *COMPILE_FLAGS, "-c", str(source), "-o", obj] for source, obj in zip(SOURCES, objects)]
        for command in (*compiles, [compiler, *objects, "-o", str(lib), *LINK_FLAGS]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-400:]}")
        os.replace(lib, target)


@functools.cache
def load() -> DecodeAttention | None:
    """The kernel, built on first use (in the cache folder, else a temp folder when that is not writable);
    None (logged once) when it cannot be built here."""
    lib = library()
    return None if lib is None else DecodeAttention(lib)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The shared object of every decode kernel (see SOURCES), built on first use; None (logged once) when it
    cannot be built here."""
    error: Exception | None = None
    for root in (_cache_dir(), Path(tempfile.gettempdir()) / f"rlhf-kernels-{os.getuid()}" / _cache_dir().name):
        target = root / "cpu_decode_kernels.so"
        try:
            if not target.exists():
                _build(target)
            return ctypes.CDLL(str(target))
        except PermissionError as denied:
            error = denied
        except (OSError, RuntimeError) as failed:
            error = failed
            break
    log.warning("fused CPU decode kernels unavailable, using torch ops: %s", error)
    return None


class DecodeAttention:
    """attend(mixed [S,G,H+2,D] raw QKV, cos_sin [S,2,D], k_cache/v_cache [slots,G,L,D], positions [S], scale)
    -> [S, G*H*D]: RoPE on q and k, k and v written at each slot's position, attention over its positions.
    Tensors all fp32 or all bf16 (then the arithmetic is fp32 and the cache and output are rounded to bf16)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {torch.float32: library.rlhf_decode_attention, torch.bfloat16: library.rlhf_decode_attention_bf16}
        for fn in self._fns.values():
            fn.restype = None
            fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _PTR]
        self._rms_norms = {torch.float32: library.rlhf_rms_norm_f32, torch.bfloat16: library.rlhf_rms_norm_bf16}
        for dtype, fn in self._rms_norms.items():  # the fp32 one also returns each row's rstd (or takes NULL)
            fn.restype = None
            fn.argtypes = [_PTR, _PTR, _I64, _I64, ctypes.c_float, _PTR, *([_PTR] if dtype == torch.float32 else [])]
        self._prefill_ropes = {torch.float32: library.rlhf_prefill_rope_f32,
                               torch.bfloat16: library.rlhf_prefill_rope_bf16}
        for fn in self._prefill_ropes.values():
            fn.restype = None
            fn.argtypes = [_PTR, _PTR, _PTR, *[_I64] * 6, *[_PTR] * 5, ctypes.c_int]
        self._scratch = torch.empty(0)

    def __call__(self, mixed: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 positions: torch.Tensor, scale: float) -> torch.Tensor:
        slots, groups, heads_and_kv, head_dim = mixed.shape
        heads, max_len = heads_and_kv - 2, k_cache.shape[2]
        assert mixed.is_contiguous() and cos_sin.is_contiguous() and positions.is_contiguous()
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and positions.dtype == torch.int64
        assert mixed.dtype == cos_sin.dtype == k_cache.dtype == v_cache.dtype and mixed.dtype in self._fns
        assert k_cache.shape[1:] == (groups, max_len, head_dim) and cos_sin.shape == (slots, 2, head_dim)
        if self._scratch.numel() < heads * (max_len + head_dim):
            self._scratch = torch.empty(heads * (max_len + head_dim))
        out = torch.empty(slots, groups * heads * head_dim, dtype=mixed.dtype)
        self._fns[mixed.dtype](mixed.data_ptr(), cos_sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                               positions.data_ptr(), slots, groups, heads, head_dim, max_len, scale, out.data_ptr(),
                               self._scratch.data_ptr())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`F.rms_norm(x, (d,), weight, eps)` over the last dim for fp32 or bf16 `x` and `weight` (one dtype) in one
        pass (the step's norms live in the same library); other dtypes, or a non-contiguous `x`, go to torch's op."""
        if x.dtype not in self._rms_norms or weight.dtype != x.dtype or not x.is_contiguous():
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        assert weight.is_contiguous() and weight.shape == (x.shape[-1],)
        out = torch.empty_like(x)
        rstd = (None,) if x.dtype == torch.float32 else ()
        self._rms_norms[x.dtype](x.data_ptr(), weight.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps,
                                 out.data_ptr(), *rstd)
        return out

    def prefill_rope(self, mixed: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, token_major: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """fp32 or bf16 prefill: raw QKV `mixed` [P, L, G, H+2, D], `cos_sin` [L, 2, D], caches [slots, G, max_len, D]
        -> RoPE'd q [P, G*H, L, D], k and v [P, G, L, D] (`token_major`: q [P, L, G*H, D], k and v [P, L, G, D]), k
        and v also written at positions 0..L-1 of cache rows `slots` [P]. None for other dtypes (the caller's torch
        path)."""
        if mixed.dtype not in self._prefill_ropes:
            return None
        prompts, length, groups, heads_and_kv, head_dim = mixed.shape
        heads, max_len = heads_and_kv - 2, k_cache.shape[2]
        assert mixed.is_contiguous() and cos_sin.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert cos_sin.dtype == k_cache.dtype == v_cache.dtype == mixed.dtype and slots.dtype == torch.int64
        assert cos_sin.shape == (length, 2, head_dim) and k_cache.shape[1:] == (groups, max_len, head_dim)
        slots = slots.contiguous()
        if token_major:
            q = mixed.new_empty(prompts, length, groups * heads, head_dim)
            k, v = (mixed.new_empty(prompts, length, groups, head_dim) for _ in range(2))
        else:
            q = mixed.new_empty(prompts, groups * heads, length, head_dim)
            k, v = (mixed.new_empty(prompts, groups, length, head_dim) for _ in range(2))
        self._prefill_ropes[mixed.dtype](mixed.data_ptr(), cos_sin.data_ptr(), slots.data_ptr(), prompts, length,
                                         groups, heads, head_dim, max_len, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                         k_cache.data_ptr(), v_cache.data_ptr(), int(token_major))
        return q, k, v

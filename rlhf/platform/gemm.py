"""fp32 GEMMs on CPU through oneDNN's inner product instead of torch's BLAS (MKL).

MKL chooses its code path by CPU vendor: on a 2-core AMD EPYC with AVX-512 (Zen 5), torch's fp32 GEMMs ran 94-114
GFLOP/s at one thread where oneDNN's inner product, which chooses its kernels by instruction set, ran 208-263 on the
same shapes: SmolLM2's and the tiny model's linears forward, dgrad and wgrad, the transposed operands passed as
strided views, not copies (`benchmarks/bench_gemm.py`). oneDNN compiles a kernel per shape (0.5-2 ms) and caches
it, and a packed micro-batch has a new token count every step, so the token dimension is padded with zero rows to
one of 16 sizes per octave (at most 6.25% more rows; `padded_rows`) and the real rows copied out of the result.
In inference mode (the rollout's prefill: a new token count with every batch of prompts, and nothing saved) the
rows run unpadded: the pad copy in, the extra rows and the kernel's first-call compile (~3 ms a shape, 4 shapes a
forward) cost less than the padding did (SmolLM2, 32 prompts, 774 tokens: prefill 806 -> 776 ms).

`linear`, `add_linear`, `matmul` and `add_weight_grad_` are what training's linears (megatron's forward, dgrad and
wgrad via `compat.megatron_host` / `compat.megatron`), the fused LM head and the rollout's prefill call. They take
oneDNN for CPU fp32 operands of at least MIN_MACS multiply-adds, outside autocast, where no autograd graph is being
recorded (they run inside autograd Functions' forward and backward, or under no_grad); everything else is torch's
op. `ENABLED` (tests) switches it off.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rlhf.platform.compat.torch import ONEDNN_LINEAR_POINTWISE

ENABLED = ONEDNN_LINEAR_POINTWISE is not None
# Multiply-adds below which torch's GEMM stays: oneDNN's ~10 us more per call (same AMD host: 0.75x at 128 x 64 x 64,
# 1.07x at 64 x 64 x 256, 1.66x at 128 x 64 x 256; decode-sized calls of small models are below it).
MIN_MACS = 1 << 20
# The wgrad's product is added to the grad buffer in a pass of its own (oneDNN's inner product has no in-place
# accumulation), and both operands are padded: it pays from more multiply-adds (tiny Qwen2's qkv at 375 tokens,
# 3M: 0.81x; fc1 at 1221, 20M: 1.23x) and for an output that stays in cache (SmolLM2's [49152, 576] head, 113 MB,
# was 0.97x at 375 tokens; its 1.3-7 MB linears 1.6-2.1x): else torch's addmm_ (beta = 1, in place).
WGRAD_MIN_MACS = 1 << 23
WGRAD_MAX_OUTPUT = 1 << 22


def _routes(macs: int, *tensors: torch.Tensor) -> bool:
    if not ENABLED or macs < MIN_MACS or torch.is_autocast_enabled("cpu"):
        return False
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.numel() == 0 for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def padded_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of 1/16 of its octave's start (16 at least): few distinct GEMM shapes."""
    step = 1 << max(4, rows.bit_length() - 5)
    return -(-rows // step) * step


def fill_rows(rows: int, dtype: torch.dtype, device: torch.device, width: int) -> int:
    """Tokens to fill a packed micro-batch of `rows` tokens to (`stages.micro_batches`): where this module's GEMMs
    take oneDNN (CPU, fp32 compute, and the model's smallest linears, `width` x `width` per token for its hidden
    size `width`, at least MIN_MACS) the `padded_rows` they pad to anyway, so a pack filled that far (its filler a
    sequence of its own, outside every loss) spares each linear its padding copy and the copy of its real rows back
    out (SmolLM2's GRPO step 5% faster, the tiny model's 2.5%); else `rows` (torch's GEMMs pad nothing)."""
    if not ENABLED or device.type != "cpu" or dtype != torch.float32 or rows * width * width < MIN_MACS:
        return rows
    return padded_rows(rows)


def _pad(x_mk: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` with zero rows up to `rows`, row- or column-major (oneDNN's plain layouts)."""
    if x_mk.shape[0] == rows and (x_mk.is_contiguous() or x_mk.t().is_contiguous()):
        return x_mk
    padded = x_mk.new_empty(rows, x_mk.shape[1])
    padded[:x_mk.shape[0]].copy_(x_mk)
    padded[x_mk.shape[0]:].zero_()
    return padded


def linear(x: torch.Tensor, weight_nk: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias): `x [..., k] @ weight [n, k]^T`; `weight` may be a strided view."""
    if weight_nk.dim() != 2 or x.dim() < 1 or not _routes(x.numel() * weight_nk.shape[0], x, weight_nk):
        return F.linear(x, weight_nk)
    if not (weight_nk.is_contiguous() or weight_nk.t().is_contiguous()):
        weight_nk = weight_nk.contiguous()
    x_mk = x.reshape(-1, x.shape[-1])
    rows = x_mk.shape[0]
    padded = rows if torch.is_inference_mode_enabled() else padded_rows(rows)
    y_mn = ONEDNN_LINEAR_POINTWISE(_pad(x_mk, padded), weight_nk, None, "none", [], "")
    if padded != rows:  # the real rows: a copy, as what autograd saves must not keep the padding alive
        y_mn = y_mn[:rows].clone()
    return y_mn.view(*x.shape[:-1], weight_nk.shape[0])


def add_linear(residual: torch.Tensor, x: torch.Tensor, weight_nk: torch.Tensor) -> torch.Tensor:
    """`residual + x @ weight^T` (torch's one `addmm` for a 2-D `x` where `linear` would not take oneDNN)."""
    if weight_nk.dim() == 2 and x.dim() == 2 and not _routes(x.numel() * weight_nk.shape[0], x, weight_nk):
        return torch.addmm(residual, x, weight_nk.t())
    return linear(x, weight_nk).add_(residual)


def matmul(a: torch.Tensor, b_kn: torch.Tensor) -> torch.Tensor:
    """`torch.matmul(a, b)`; for a 2-D `b` and `a [..., m, k]` through `linear(a, b.t())`."""
    if b_kn.dim() != 2 or a.dim() < 2:
        return torch.matmul(a, b_kn)
    return linear(a, b_kn.t())


def add_weight_grad_(main_grad_nk: torch.Tensor, grad_output_mn: torch.Tensor, input_mk: torch.Tensor) -> None:
    """`main_grad += grad_output^T @ input` in place (the wgrad of `y = x @ W^T`; m, the reduction, is padded)."""
    macs = grad_output_mn.numel() * input_mk.shape[-1]
    if (grad_output_mn.dim() != 2 or input_mk.dim() != 2 or macs < WGRAD_MIN_MACS
            or main_grad_nk.numel() > WGRAD_MAX_OUTPUT or not _routes(macs, main_grad_nk, grad_output_mn, input_mk)):
        main_grad_nk.addmm_(grad_output_mn.t(), input_mk)
        return
    rows = padded_rows(input_mk.shape[0])
    product = ONEDNN_LINEAR_POINTWISE(_pad(grad_output_mn, rows).t(), _pad(input_mk, rows).t(), None, "none", [], "")
    main_grad_nk.add_(product)


class _Matmuls(TorchFunctionMode):
    """`torch.matmul` / `Tensor.matmul` calls (without out=) go to `matmul`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.Tensor.matmul) and not kwargs and len(args) == 2:
            return matmul(*args)
        return func(*args, **(kwargs or {}))


def matmuls() -> contextlib.AbstractContextManager:
    """A context in which `torch.matmul` and `Tensor.matmul` take `matmul` (for third-party code: megatron's
    linear backward); a no-op context where oneDNN is absent."""
    return _Matmuls() if ENABLED else contextlib.nullcontext()

"""Inference-time linear layers with the weight laid out once for the device's fastest kernel.

On CPU, oneDNN's inner-product kernel on a weight reordered into its blocked layout runs the decode-sized
GEMMs of a rollout (a few dozen rows against a weight streamed from memory) 1.3-1.7x faster than
`F.linear` on the row-major weight, and fuses the residual add, SiLU and the SwiGLU product into the same
kernel. bf16 weights go the same way to oneDNN's AMX / AVX512-BF16 kernels (fp32 accumulation, bf16 out):
1.5-2x faster than `F.linear` in bf16 at decode sizes, 3-4x faster than the packed fp32 GEMM on a Xeon with AMX.
fp32 weights on a CPU at one torch thread go instead to rlhf's decode GEMM (`rlhf.kernels.cpu_decode_gemm`: its own
packed panels, the next panel prefetched while this one is used) for calls of at most DECODE_GEMM_ROWS rows, 1.1-1.4x
oneDNN's packed fp32 kernel at 32 rows (2-core Xeon), ~0.93x at 64-128; larger calls (prefill) and unpacked weights
run `rlhf.platform.gemm.linear` on the weight (oneDNN on an unpacked fp32 weight, else torch).
The reorder is a copy, so a `PreparedLinear` must be rebuilt when its weight changes. Small weights
(where oneDNN's per-call overhead exceeds the GEMM) and every other device use plain torch ops; the
callers' code is the same either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf.platform import gemm, huge_pages
from rlhf.platform.compat.torch import ONEDNN_BF16, ONEDNN_LINEAR_POINTWISE, ONEDNN_REORDER_LINEAR_WEIGHT

# Below this many fp32 weight elements oneDNN's fixed per-call cost outweighs its faster GEMM (measured on a
# 2-core AVX-512 host: break-even near 64x1024 at 32 rows).
MIN_PACKED_NUMEL = 1 << 17
# bf16 (AMX / AVX512-BF16 kernels): packed was faster from 64x256 up at 32 rows (1.1x; 1.8x at 512x512) on a
# 2-core Xeon with AMX, where torch's own bf16 GEMM is slow for small weights.
MIN_PACKED_NUMEL_BF16 = 1 << 14
# oneDNN in this torch build, with the (private, inductor-used) reorder/linear ops this module calls.
ONEDNN_PACKING = ONEDNN_REORDER_LINEAR_WEIGHT is not None and ONEDNN_LINEAR_POINTWISE is not None
# Rows up to which calls go to the decode GEMM, whose packed copy replaces oneDNN's (one weight-sized copy, not two).
# 2-core Xeon, 576x3072 fp32, vs oneDNN packed / F.linear: 1.14x / 1.5x at 32 rows, 1.04x / 1.4x at 48, 0.91x /
# 1.2x at 64, 0.94x / 1.07x at 128, 0.92x / 0.99x at 256 (its ~100 GFLOP/s against MKL's ~140 once compute-bound):
# beyond 128 rows `gemm.linear` on the weight runs.
DECODE_GEMM_ROWS = 128


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` gets a oneDNN-packed copy: fp32 (or bf16 where the CPU has oneDNN's bf16 kernels) on a CPU
    build with oneDNN, and large enough (a test forcing packing sets MIN_PACKED_NUMEL = 0: both dtypes follow)."""
    smallest = {torch.float32: MIN_PACKED_NUMEL}
    if ONEDNN_BF16:
        smallest[torch.bfloat16] = min(MIN_PACKED_NUMEL, MIN_PACKED_NUMEL_BF16)
    return (ONEDNN_PACKING and weight.device.type == "cpu" and weight.dtype in smallest
            and weight.dim() == 2 and weight.numel() >= smallest[weight.dtype])


def decode_gemm(weight: torch.Tensor):
    """rlhf's decode-GEMM kernel for `weight` (`rlhf.kernels.cpu_decode_gemm.DecodeGemm`), or None: fp32 on a CPU at
    one torch thread (the kernel is single-threaded; with more threads oneDNN's threaded kernel stays), where the
    kernel library builds."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or torch.get_num_threads() != 1:
        return None
    from rlhf.kernels.cpu_decode_gemm import load

    return load()


class PreparedLinear:
    """y = x @ W^T (+ b), or residual + x @ W^T (+ b) in one kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True,
                 batch_hint: int = 32) -> None:
        self.weight, self.bias = weight, bias
        packs = pack and can_pack(weight)
        self.gemm = decode_gemm(weight) if packs else None
        self.gemm_packed = (self.gemm.pack(weight, huge_pages.empty(self.gemm.packed_numel(weight)))
                            if self.gemm is not None else None)
        self.packed = (ONEDNN_REORDER_LINEAR_WEIGHT(weight.detach(), batch_hint)
                       if packs and self.gemm is None else None)

    @property
    def kernel(self) -> str:
        """Which GEMM serves decode-sized calls: "decode_gemm" (rlhf's), "onednn" (packed) or "torch"."""
        return "decode_gemm" if self.gemm is not None else "onednn" if self.packed is not None else "torch"

    def _decodes(self, x: torch.Tensor) -> bool:
        return self.gemm is not None and x.numel() <= DECODE_GEMM_ROWS * x.shape[-1]

    def _decode(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = self.gemm.linear(x, self.gemm_packed, self.weight.shape[0], residual)
        return out if self.bias is None else out.add_(self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._decodes(x):
            return self._decode(x)
        if self.packed is None:
            if x.numel() * self.weight.shape[0] < gemm.MIN_MACS:  # torch's GEMM (gemm.linear would be too)
                return F.linear(x, self.weight, self.bias)
            out = gemm.linear(x, self.weight)
            return out if self.bias is None else out.add_(self.bias)
        return ONEDNN_LINEAR_POINTWISE(x, self.packed, self.bias, "none", [], "")

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W^T (+ b): the residual add happens inside the GEMM."""
        if self._decodes(x):
            return self._decode(x, residual)
        if self.packed is not None:
            return ONEDNN_LINEAR_POINTWISE.binary(x, residual, self.packed, self.bias, "add")
        out = gemm.add_linear(residual, x, self.weight)
        return out if self.bias is None else out.add_(self.bias)

    def _silu(self, x: torch.Tensor) -> torch.Tensor:
        assert self.packed is not None
        return ONEDNN_LINEAR_POINTWISE(x, self.packed, self.bias, "swish", [], "")

    def _mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        assert self.packed is not None
        return ONEDNN_LINEAR_POINTWISE.binary(x, other, self.packed, self.bias, "mul")


class PreparedSwiGLU:
    """silu(x @ Wg^T) * (x @ Wu^T) for Megatron's gated `linear_fc1` weight [gate rows; up rows].

    Packed: two GEMMs with SiLU and the product fused in, or (the decode GEMM) one GEMM on the fused weight and
    one pass for SiLU and product. Otherwise: one GEMM on the fused weight, then chunk, SiLU and product as
    separate ops (fewer ops than splitting, which is what small models need).
    """

    def __init__(self, fc1_weight: torch.Tensor, *, pack: bool = True, batch_hint: int = 32) -> None:
        gate, up = fc1_weight.chunk(2, dim=0)
        self.fused: torch.Tensor | None = fc1_weight
        self.decode: PreparedLinear | None = None  # the decode GEMM on the fused weight, then its SwiGLU
        packs = pack and can_pack(gate)
        if packs and decode_gemm(fc1_weight) is not None:
            self.decode = PreparedLinear(fc1_weight, batch_hint=batch_hint)
        elif packs:
            self.gate = PreparedLinear(gate, batch_hint=batch_hint)
            self.up = PreparedLinear(up, batch_hint=batch_hint)
            self.fused = None

    @property
    def kernel(self) -> str:
        """As `PreparedLinear.kernel`, for decode-sized calls."""
        return "decode_gemm" if self.decode is not None else "onednn" if self.fused is None else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode is not None:  # any row count: the kernel's one SwiGLU pass after either GEMM
            return self.decode.gemm.swiglu(self.decode(x))
        if self.fused is not None:
            gate, up = gemm.linear(x, self.fused).chunk(2, dim=-1)
            return F.silu(gate) * up
        return self.up._mul(x, self.gate._silu(x))

"""The decode-size fp32 GEMM equals `F.linear` (any row count, a width that is not a whole number of panels, the
residual add, a bias) and its SwiGLU pass equals torch's; `PreparedLinear` / `PreparedSwiGLU` route decode-sized
calls to it at one torch thread and everything else to their other paths."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from rlhf.kernels import cpu_decode_gemm
from rlhf.platform import linear

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 32, 33])
@pytest.mark.parametrize("n, k", [(96, 64), (50, 24), (130, 200)])  # whole panels, one partial, several + partial
def test_linear_equals_f_linear(rows, n, k):
    gemm = cpu_decode_gemm.load()
    gen = torch.Generator().manual_seed(rows * n + k)
    weight, x, residual = (torch.randn(*shape, generator=gen) for shape in ((n, k), (rows, k), (rows, n)))
    packed = gemm.pack(weight)
    assert packed.numel() == -(-n // cpu_decode_gemm.PANEL) * cpu_decode_gemm.PANEL * k
    expected = x.double() @ weight.double().t()
    torch.testing.assert_close(gemm.linear(x, packed, n).double(), expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(gemm.linear(x, packed, n, residual).double(), expected + residual, rtol=0, atol=1e-4)
    # leading dims are kept; a non-contiguous input is read as its values
    x3 = torch.randn(k, rows, generator=gen).t()[None]
    torch.testing.assert_close(gemm.linear(x3, packed, n), F.linear(x3, weight), rtol=0, atol=1e-4)


def test_swiglu_equals_torch():
    gemm = cpu_decode_gemm.load()
    gate_up = torch.randn(5, 2, 2 * 37, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(gemm.swiglu(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_prepared_linears_route_decode_calls_to_the_kernel(monkeypatch):
    monkeypatch.setattr(linear, "MIN_PACKED_NUMEL", 0)
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(100, 64, generator=gen), torch.randn(100, generator=gen)
    fc1 = torch.randn(80, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        prepared, swiglu = linear.PreparedLinear(weight, bias), linear.PreparedSwiGLU(fc1)
        torch.set_num_threads(2)
        threaded = linear.PreparedLinear(weight, bias)
    finally:
        torch.set_num_threads(threads)
    assert prepared.kernel == "decode_gemm" and swiglu.decode is not None
    assert threaded.kernel == ("onednn" if linear.ONEDNN_PACKING else "torch")  # the kernel is single-threaded
    assert linear.PreparedLinear(weight.bfloat16()).kernel != "decode_gemm"
    assert linear.PreparedLinear(weight, pack=False).kernel == "torch"
    for rows in (3, linear.DECODE_GEMM_ROWS, linear.DECODE_GEMM_ROWS + 1):  # the last: F.linear on the weight
        x, residual = torch.randn(rows, 64, generator=gen), torch.randn(rows, 100, generator=gen)
        torch.testing.assert_close(prepared(x), F.linear(x, weight, bias), rtol=0, atol=1e-4)
        torch.testing.assert_close(prepared.add_to(residual, x), residual + F.linear(x, weight, bias), rtol=0,
                                   atol=1e-4)
        gate, up = F.linear(x, fc1).chunk(2, dim=-1)
        torch.testing.assert_close(swiglu(x), F.silu(gate) * up, rtol=0, atol=1e-4)

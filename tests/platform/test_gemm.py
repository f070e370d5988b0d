"""fp32 CPU GEMMs through oneDNN (`rlhf.platform.gemm`): the forward, dgrad and wgrad products equal torch's to fp32
rounding against float64 on shapes whose token dimension is padded and on ones that are not, with strided
operands; autograd-recorded, autocast, small, non-fp32 and disabled calls, and weight gradients below the wgrad
limits, are torch's op bit for bit; a megatron model's forward and its linears' backward (`Tensor.matmul` inside
their autograd Function) take them, with torch's gradients to fp32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf.platform import gemm

pytestmark = pytest.mark.skipif(not gemm.ENABLED, reason="torch built without oneDNN")


def _error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().max())


def test_padded_rows_bound_the_shapes_and_the_waste():
    assert [gemm.padded_rows(n) for n in (1, 16, 17, 31, 255, 256, 257, 1216, 1217)] == [
        16, 16, 32, 32, 256, 256, 272, 1216, 1280]
    for rows in range(1, 5000):
        padded = gemm.padded_rows(rows)
        assert 0 <= padded - rows < max(16, rows / 16)
    assert len({gemm.padded_rows(n) for n in range(1025, 2049)}) == 16  # 1088, 1152, ..., 2048


@pytest.mark.parametrize("rows", [1216, 1221, 7, 300])  # a multiple of its step, padded, tiny, another octave
def test_products_equal_torch_within_fp32_rounding(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(160, 96, generator=generator)
    grad = torch.randn(rows, 160, generator=generator)
    saved = gemm.MIN_MACS, gemm.WGRAD_MIN_MACS
    gemm.MIN_MACS = gemm.WGRAD_MIN_MACS = 0
    try:
        products = {
            "forward": (gemm.linear(x, weight), F.linear(x, weight), x.double() @ weight.double().t()),
            "dgrad": (gemm.matmul(grad, weight), grad @ weight, grad.double() @ weight.double()),
        }
        main_grad, reference = torch.randn(160, 96, generator=generator), None
        reference = main_grad.clone().addmm_(grad.t(), x)
        exact = main_grad.double() + grad.double().t() @ x.double()
        gemm.add_weight_grad_(main_grad, grad, x)
        products["wgrad"] = (main_grad, reference, exact)
    finally:
        gemm.MIN_MACS, gemm.WGRAD_MIN_MACS = saved
    for name, (got, torch_result, exact) in products.items():
        assert got.shape == torch_result.shape and got.dtype == torch.float32, name
        assert _error(got, exact) <= 4 * _error(torch_result, exact) + 1e-7, name


def test_padded_outputs_copy_the_real_rows_and_inference_mode_runs_unpadded():
    """Outside inference mode the result owns only its rows (autograd may save it); in inference mode (the rollout's
    prefill) the rows run unpadded: no pad copy, no copy out, the same values."""
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(1221, 96, generator=generator), torch.randn(160, 96, generator=generator)
    assert gemm.padded_rows(1221) == 1280
    copied = gemm.linear(x, weight)
    with torch.inference_mode():
        unpadded = gemm.linear(x, weight)
    assert copied.untyped_storage().nbytes() == 1221 * 160 * 4
    assert unpadded.untyped_storage().nbytes() == 1221 * 160 * 4 and unpadded.shape == (1221, 160)
    assert torch.equal(copied, unpadded)


def test_leading_dimensions_and_strided_operands():
    generator = torch.Generator().manual_seed(1)
    x_sbk = torch.randn(33, 2, 128, generator=generator)  # megatron's [s, b, h]
    weight_nk = torch.randn(256, 128, generator=generator)
    torch.testing.assert_close(gemm.linear(x_sbk, weight_nk), F.linear(x_sbk, weight_nk), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemm.matmul(x_sbk, weight_nk.t()), x_sbk @ weight_nk.t(), rtol=1e-5, atol=1e-5)
    strided = torch.randn(66, 3, 128, generator=generator)[::2, 1]  # rows 2 apart
    torch.testing.assert_close(gemm.linear(strided, weight_nk), F.linear(strided, weight_nk), rtol=1e-5, atol=1e-5)
    every_other = torch.randn(256, 256, generator=generator)[:, ::2]  # a weight neither row- nor column-major
    torch.testing.assert_close(gemm.linear(strided, every_other), F.linear(strided, every_other), rtol=1e-5,
                               atol=1e-5)


def test_other_calls_are_torch_bit_for_bit(monkeypatch):
    generator = torch.Generator().manual_seed(2)
    x, weight = torch.randn(300, 128, generator=generator), torch.randn(256, 128, generator=generator)
    leaf = weight.clone().requires_grad_()
    out = gemm.linear(x, leaf)  # recorded by autograd: torch's op, with its backward
    assert out.grad_fn is not None and torch.equal(out, F.linear(x, leaf))
    small = torch.randn(8, 16, generator=generator)
    assert torch.equal(gemm.linear(small, weight[:32, :16]), F.linear(small, weight[:32, :16]))  # below MIN_MACS
    assert torch.equal(gemm.linear(x.double(), weight.double()), F.linear(x.double(), weight.double()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gemm.linear(x, weight).dtype == torch.bfloat16
    grad = torch.randn(300, 256, generator=generator)
    for limit in ("WGRAD_MIN_MACS", "WGRAD_MAX_OUTPUT"):  # a small product, an output too large for cache
        with monkeypatch.context() as patch:
            patch.setattr(gemm, limit, 300 * 256 * 128 + 1 if limit == "WGRAD_MIN_MACS" else 256 * 128 - 1)
            main_grad = torch.ones(256, 128)
            gemm.add_weight_grad_(main_grad, grad, x)
            assert torch.equal(main_grad, torch.ones(256, 128).addmm_(grad.t(), x)), limit
    monkeypatch.setattr(gemm, "ENABLED", False)
    assert torch.equal(gemm.linear(x, weight), F.linear(x, weight))
    main_grad = torch.zeros(256, 128)
    gemm.add_weight_grad_(main_grad, torch.ones(300, 256), x)
    assert torch.equal(main_grad, torch.zeros(256, 128).addmm_(torch.ones(300, 256).t(), x))


def test_matmuls_context_takes_tensor_matmul():
    generator = torch.Generator().manual_seed(3)
    grad, weight = torch.randn(300, 256, generator=generator), torch.randn(256, 128, generator=generator)
    calls = []
    original = gemm.ONEDNN_LINEAR_POINTWISE
    try:
        gemm.ONEDNN_LINEAR_POINTWISE = lambda *args: calls.append(args[0].shape) or original(*args)
        with gemm.matmuls():
            got = grad.matmul(weight)
            also = torch.matmul(grad, weight)
    finally:
        gemm.ONEDNN_LINEAR_POINTWISE = original
    assert calls == [(304, 256), (304, 256)]  # 300 rows padded to 304
    torch.testing.assert_close(got, grad @ weight, rtol=1e-5, atol=1e-4)  # sums of 256 products ~16
    assert torch.equal(got, also)


def _megatron_grads(enabled: bool) -> tuple[dict, list[str]]:
    from rlhf.models.builder import build_gpt
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from tests.models.tiny import VOCAB, llama_config

    gemm.ENABLED = enabled
    phases, original = [], gemm.ONEDNN_LINEAR_POINTWISE
    gemm.ONEDNN_LINEAR_POINTWISE = lambda *args: phases.append(phase) or original(*args)
    torch.manual_seed(0)
    model = build_gpt(llama_config(max_position_embeddings=1024), build_layout_groups(ParallelLayout()))
    tokens = torch.randint(0, VOCAB, (2, 300), generator=torch.Generator().manual_seed(1))
    phase = "forward"
    logits = model(tokens, torch.arange(300)[None].expand(2, -1), None)
    phase = "backward"
    logits.float().pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, phases


def _rank_grads() -> tuple[float, list[str]]:
    onednn, phases = _megatron_grads(True)
    reference, none = _megatron_grads(False)
    assert none == []
    worst = max(float((onednn[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in reference.items())
    return worst, phases


def test_megatron_linears_take_onednn_forward_and_backward():
    from rlhf.testing.distributed import run_distributed

    worst, phases = run_distributed(_rank_grads, 1, timeout_s=300)[0]
    assert phases.count("forward") >= 4 * 4 and phases.count("backward") >= 2 * 4 * 4, phases  # 4 layers x 4
    assert worst < 1e-5, worst

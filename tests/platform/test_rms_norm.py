"""rlhf's training RMSNorm (`rlhf.platform.rms_norm`): the kernel library's fp32 forward and backward equal torch's
`nn.RMSNorm` to rounding, other inputs take torch's op bit for bit, and megatron's built model uses it."""

import shutil

import pytest
import torch

from rlhf.platform import rms_norm
from rlhf.platform.rms_norm import FusedRMSNorm, use_fused_rms_norms

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")


def _pair(hidden: int, eps: float = 1e-5, seed: int = 0) -> tuple[torch.nn.RMSNorm, torch.nn.RMSNorm]:
    reference = torch.nn.RMSNorm(hidden, eps=eps)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    fused = torch.nn.RMSNorm(hidden, eps=eps)
    fused.load_state_dict(reference.state_dict())
    assert use_fused_rms_norms(fused) == 1 and type(fused) is FusedRMSNorm
    return reference, fused


def _forward_backward(norm: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().requires_grad_()
    out = norm(x)
    out.backward(grad)
    return out.detach(), x.grad, norm.weight.grad


@needs_gcc
@pytest.mark.parametrize("shape", [(128, 2, 576), (3, 5, 96), (1, 17)])
def test_fp32_forward_and_grads_are_as_accurate_as_torchs_norm(shape):
    """Against the same norm in float64: the kernel's error is within a few times torch's fp32 op's (another
    summation order, so not bitwise) and small in absolute terms."""
    generator = torch.Generator().manual_seed(1)
    x, grad = torch.randn(*shape, generator=generator) * 3, torch.randn(*shape, generator=generator)
    reference, fused = _pair(shape[-1])
    in_float64 = torch.nn.RMSNorm(shape[-1], eps=1e-5, dtype=torch.float64)
    in_float64.load_state_dict(reference.state_dict())
    exact = _forward_backward(in_float64, x.double(), grad.double())
    torchs, got = _forward_backward(reference, x, grad), _forward_backward(fused, x, grad)
    for name, mine, theirs, truth in zip(("out", "grad_x", "grad_weight"), got, torchs, exact):
        scale = truth.abs().max().item()
        error, torch_error = (mine.double() - truth).abs().max().item(), (theirs.double() - truth).abs().max().item()
        assert error <= 4 * torch_error + 1e-7 * scale and error <= 1e-6 * scale, (name, error, torch_error, scale)


@needs_gcc
def test_weight_grad_accumulates_and_frozen_weight_gets_none():
    generator = torch.Generator().manual_seed(2)
    x, grad = torch.randn(4, 32, generator=generator), torch.randn(4, 32, generator=generator)
    _, fused = _pair(32)
    _, _, once = _forward_backward(fused, x, grad)
    once = once.clone()
    _, _, twice = _forward_backward(fused, x, grad)
    torch.testing.assert_close(twice, 2 * once)
    fused.weight.grad = None
    fused.weight.requires_grad_(False)
    _, grad_x, weight_grad = _forward_backward(fused, x, grad)
    assert weight_grad is None and grad_x is not None


def test_other_inputs_take_torchs_op_bit_for_bit(monkeypatch):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 64, generator=generator)
    reference, fused = _pair(64)
    strided = x.transpose(0, 1)
    assert torch.equal(fused(strided), reference(strided))
    assert torch.equal(fused(x.double()), reference(x.double()))
    monkeypatch.setattr(rms_norm, "MAX_SINGLE_THREAD_NUMEL", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(fused(x), reference(x))  # several threads, a large input: torch's threaded op
    finally:
        torch.set_num_threads(threads)


def _norm_types_of_a_built_model() -> tuple[list[str], bool]:
    from rlhf.models.builder import build_gpt
    from rlhf.parallel.groups import GroupCache, build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from tests.models.tiny import qwen3_config

    groups = build_layout_groups(ParallelLayout(tp=1, pp=1, dp=1), GroupCache())
    model = build_gpt(qwen3_config(num_hidden_layers=2), groups)
    names = [type(module).__name__ for module in model.modules() if isinstance(module, torch.nn.RMSNorm)]
    return names, any(name.endswith("final_layernorm.weight") for name in model.state_dict())


def test_a_built_models_norms_are_fused_with_torchs_state_dict():
    from rlhf.testing.distributed import run_distributed

    names, has_final_norm = run_distributed(_norm_types_of_a_built_model, 1, timeout_s=120)[0]
    # two per layer, the per-head q and k norms of each layer, the final norm
    assert names == ["FusedRMSNorm"] * (2 * 2 + 2 * 2 + 1) and has_final_norm

"""rlhf's training SwiGLU (`rlhf.platform.swiglu`): the kernel library's fp32 forward and backward are as accurate as
megatron's torch formula (chunk, silu, mul), other inputs take that formula bit for bit, and dense models built by
`rlhf.models.builder` use it (MoE ones keep megatron's activation)."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from rlhf.platform import swiglu as swiglu_module
from rlhf.platform.swiglu import swiglu

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")


def _torch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(gate_up, 2, dim=-1)
    return F.silu(gate) * up


def _forward_backward(fn, gate_up: torch.Tensor, grad: torch.Tensor):
    gate_up = gate_up.detach().requires_grad_()
    out = fn(gate_up)
    out.backward(grad)
    return out.detach(), gate_up.grad


@needs_gcc
@pytest.mark.parametrize("shape", [(128, 2, 3072), (3, 5, 18), (1, 2)])
def test_fp32_forward_and_grad_are_as_accurate_as_torchs(shape):
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(*shape, generator=generator) * 4
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=generator)
    exact = _forward_backward(_torch_swiglu, gate_up.double(), grad.double())
    torchs, got = _forward_backward(_torch_swiglu, gate_up, grad), _forward_backward(swiglu, gate_up, grad)
    assert got[1].shape == gate_up.shape
    for name, mine, theirs, truth in zip(("out", "grad"), got, torchs, exact):
        scale = truth.abs().max().item()
        error, torch_error = (mine.double() - truth).abs().max().item(), (theirs.double() - truth).abs().max().item()
        assert error <= 4 * torch_error + 1e-7 * scale and error <= 1e-6 * scale, (name, error, torch_error, scale)


def test_other_inputs_take_megatrons_formula_bit_for_bit(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    gate_up = torch.randn(4, 6, 32, generator=generator)
    strided = gate_up.transpose(0, 1)
    assert torch.equal(swiglu(strided), _torch_swiglu(strided))
    assert torch.equal(swiglu(gate_up.double()), _torch_swiglu(gate_up.double()))
    monkeypatch.setattr(swiglu_module, "MAX_SINGLE_THREAD_NUMEL", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(swiglu(gate_up), _torch_swiglu(gate_up))  # several threads, a large input: torch's ops
    finally:
        torch.set_num_threads(threads)


def _activations_of_built_models() -> dict[str, list[str]]:
    from rlhf.models.builder import build_gpt
    from rlhf.parallel.groups import GroupCache, build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from tests.models.tiny import qwen2_config, qwen3_moe_config

    groups = build_layout_groups(ParallelLayout(tp=1, pp=1, dp=1), GroupCache())
    found = {}
    for name, config in (("dense", qwen2_config(num_hidden_layers=2)), ("moe", qwen3_moe_config())):
        model = build_gpt(config, groups)
        found[name] = [type(module.activation_func).__name__ if isinstance(module.activation_func, torch.nn.Module)
                       else module.activation_func.__name__
                       for module in model.modules() if hasattr(module, "linear_fc1")]
    return found


def test_dense_models_use_it_and_moe_experts_keep_megatrons_activation():
    from rlhf.testing.distributed import run_distributed

    found = run_distributed(_activations_of_built_models, 1, timeout_s=120)[0]
    assert found["dense"] == ["FusedSwiGLU"] * 2
    assert found["moe"] and "FusedSwiGLU" not in found["moe"] and set(found["moe"]) == {"silu"}

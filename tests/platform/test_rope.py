"""rlhf's training RoPE (`rlhf.platform.rope`): the kernel library's fp32 forward and backward are as accurate as
megatron's torch formula on q (contiguous) and on k (a strided view into the fused QKV projection), other inputs
take that formula bit for bit (megatron's packed RoPE goes through it: tests/platform/compat/test_megatron.py)."""

import shutil

import pytest
import torch

from rlhf.platform import rope as rope_module
from rlhf.platform.rope import rotate

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")


def _megatron_formula(x, cos, sin):
    first, second = torch.chunk(x, 2, dim=-1)
    return (x * cos[:, None, None]) + (torch.cat((-second, first), dim=-1) * sin[:, None, None])


def _forward_backward(fn, mixed, view, cos, sin, grad):
    mixed = mixed.detach().requires_grad_()
    out = fn(view(mixed), cos, sin)
    out.backward(grad)
    return out.detach(), mixed.grad


@needs_gcc
@pytest.mark.parametrize("batch, heads, dim, view", [(1, 4, 16, "q"), (1, 4, 16, "k"), (1, 3, 64, "q"), (1, 1, 6, "k"),
                                                    (3, 4, 16, "q"), (2, 2, 8, "k")])
def test_fp32_forward_and_grad_are_as_accurate_as_megatrons(batch, heads, dim, view):
    generator = torch.Generator().manual_seed(0)
    tokens = 53
    mixed = torch.randn(tokens, batch, heads + 2, dim, generator=generator)  # [q heads, k, v] per token
    pick = (lambda m: m[:, :, :heads]) if view == "q" else (lambda m: m[:, :, heads:heads + 1])
    angles = torch.rand(tokens, dim, generator=generator) * 6
    cos, sin = angles.cos(), angles.sin()
    grad = torch.randn(tokens, batch, heads if view == "q" else 1, dim, generator=generator)
    exact = _forward_backward(_megatron_formula, mixed.double(), pick, cos.double(), sin.double(), grad.double())
    torchs = _forward_backward(_megatron_formula, mixed, pick, cos, sin, grad)
    got = _forward_backward(rotate, mixed, pick, cos, sin, grad)
    assert got[0].grad_fn is None and got[0].is_contiguous()
    for name, mine, theirs, truth in zip(("out", "grad"), got, torchs, exact):
        scale = truth.abs().max().item()
        error, torch_error = (mine.double() - truth).abs().max().item(), (theirs.double() - truth).abs().max().item()
        assert error <= 4 * torch_error + 1e-7 * scale and error <= 1e-6 * scale, (name, error, torch_error, scale)
    assert torch.equal(got[1][:, :, heads + 1:], torch.zeros_like(got[1][:, :, heads + 1:]))  # v gets no gradient


def test_other_inputs_take_megatrons_formula_bit_for_bit(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    x, angles = torch.randn(9, 1, 2, 8, generator=generator), torch.randn(9, 8, generator=generator)
    cos, sin = angles.cos(), angles.sin()
    assert torch.equal(rotate(x.double(), cos.double(), sin.double()),
                       _megatron_formula(x.double(), cos.double(), sin.double()))
    transposed = x.transpose(2, 3).contiguous().transpose(2, 3)  # last dim not contiguous
    assert torch.equal(rotate(transposed, cos, sin), _megatron_formula(transposed, cos, sin))
    monkeypatch.setattr(rope_module, "MAX_SINGLE_THREAD_NUMEL", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(rotate(x, cos, sin), _megatron_formula(x, cos, sin))  # several threads: torch's ops
    finally:
        torch.set_num_threads(threads)

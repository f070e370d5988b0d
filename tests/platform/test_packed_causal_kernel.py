"""The kernel library's packed causal attention (`rlhf.platform.packed_causal_kernel`): outputs and q/k/v gradients
against float64 attention over each sequence alone, as close as torch's fp32 attention gets (head sizes 16-80,
grouped-query ratios 1-3, sequences of 1 token to past a score tile, megatron's strided views of a fused QKV), bf16
under CPU autocast attended in fp32, and when the kernel is chosen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf.platform import packed_causal_kernel
from rlhf.platform.packed_causal_kernel import kernel_applies, packed_causal_attention

LENGTHS = (1, 2, 3, 5, 33, 64, 65, 130)  # a partial row block, exactly and just past a 32/64-key tile, > 4 tiles


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...],
           scale: float) -> torch.Tensor:
    """torch's causal attention on each sequence by itself, `[T, heads · d]`."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs)


def _fused_qkv(tokens: int, heads: int, groups: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, groups, heads // groups + 2, dim, generator=generator, dtype=dtype)


def _split(mixed: torch.Tensor, heads: int, groups: int):
    """megatron's q, k, v of the fused projection: strided views ([T, heads, d] q made contiguous, as RoPE does)."""
    tokens, dim = mixed.shape[0], mixed.shape[-1]
    q, k, v = mixed.split([heads // groups, 1, 1], dim=2)
    return q.reshape(tokens, heads, dim), k.squeeze(2), v.squeeze(2)


def _errors(heads: int, groups: int, dim: int, lengths=LENGTHS, seed: int = 0) -> tuple[list[float], list[float]]:
    """Max |error| vs float64 of (output, grad q, grad k, grad v): the kernel's and torch's fp32 attention's."""
    tokens, scale = sum(lengths), dim ** -0.5
    cu = (0, *torch.tensor(lengths).cumsum(0).tolist())
    mixed64 = _fused_qkv(tokens, heads, groups, dim, torch.float64, seed).requires_grad_()
    upstream = torch.randn(tokens, heads * dim, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    runs = []
    for attend, dtype in ((_alone, torch.float64), (None, torch.float32), (_alone, torch.float32)):
        mixed = mixed64 if dtype == torch.float64 else mixed64.detach().float().requires_grad_()
        q, k, v = _split(mixed, heads, groups)
        assert not k.is_contiguous() and not v.is_contiguous()
        if attend is None:
            assert kernel_applies(lengths, heads, dim, dtype, mixed.device)
            out = packed_causal_attention(q, k, v, cu, scale)
        else:
            out = attend(q, k, v, lengths, scale)
        (grad,) = torch.autograd.grad((out * upstream.to(dtype)).sum(), mixed)
        runs.append([out.detach().double(), *(g.double() for g in _split(grad, heads, groups))])
    exact, kernel, torch_fp32 = runs
    return ([float((a - b).abs().max()) for a, b in zip(kernel, exact)],
            [float((a - b).abs().max()) for a, b in zip(torch_fp32, exact)])


@pytest.mark.parametrize("heads,groups,dim", [(4, 2, 16), (9, 3, 64), (2, 2, 32), (3, 1, 80)])
def test_kernel_is_as_close_to_float64_as_torch(heads, groups, dim):
    kernel, reference = _errors(heads, groups, dim)
    for name, got, want in zip(("out", "grad_q", "grad_k", "grad_v"), kernel, reference):
        assert got <= 4 * want + 1e-7, (name, got, want)


def test_bf16_under_autocast_is_attended_in_fp32():
    lengths, heads, groups, dim = (7, 40), 4, 2, 16
    cu, scale = (0, 7, 47), dim ** -0.5
    mixed = _fused_qkv(47, heads, groups, dim, torch.float32, 3).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernel_applies(lengths, heads, dim, torch.bfloat16, mixed.device)
        out = packed_causal_attention(*_split(mixed, heads, groups), cu, scale)
    assert out.dtype == torch.float32
    want = _alone(*(t.float() for t in _split(mixed.detach(), heads, groups)), lengths, scale)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad(out.sum(), mixed)
    assert grad.dtype == torch.bfloat16 and grad.abs().sum() > 0


def test_kernel_is_chosen_for_fp32_cpu_packs_it_suits(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert kernel_applies((40, 1), 4, 16, torch.float32, cpu)
    assert not kernel_applies((40,), 4, 24, torch.float32, cpu)  # head size not a multiple of 16
    assert not kernel_applies((40,), 4, 16, torch.float64, cpu)
    assert not kernel_applies((40,), 4, 16, torch.bfloat16, cpu)  # bf16 only under autocast
    assert not kernel_applies((packed_causal_kernel.MAX_SEQUENCE + 1,), 4, 16, torch.float32, cpu)
    assert kernel_applies((packed_causal_kernel.MAX_SEQUENCE,), 4, 16, torch.float32, cpu)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert kernel_applies((40,), 4, 16, torch.float32, cpu)  # small: one core still wins
    assert not kernel_applies((2048,) * 4, 9, 64, torch.float32, cpu)  # large: torch's threaded flash kernel

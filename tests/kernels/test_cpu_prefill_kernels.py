"""The helpers in the CPU kernel library: RMSNorm in one pass and the prefill's RoPE + cache writes (fp32 and bf16)
equal the torch ops they replace in `rlhf.rollout.native.forward` (fp32 arithmetic, in bf16 one rounding)."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from rlhf.kernels import cpu_decode_attention
from rlhf.rollout.native.forward import _rope

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")


@needs_gcc
def test_rms_norm_is_the_fp32_norm_rounded_to_bf16():
    kernel = cpu_decode_attention.load()
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 96, generator=generator) * 4).bfloat16()
    weight = torch.randn(96, generator=generator).bfloat16()
    got = kernel.rms_norm(x, weight, 1e-5)
    expected = F.rms_norm(x.float(), (96,), weight.float(), 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -8, atol=0)  # within one bf16 rounding
    torch.testing.assert_close(got, F.rms_norm(x, (96,), weight, 1e-5), rtol=2 ** -7, atol=0)  # torch's bf16 op


@needs_gcc
def test_rms_norm_fp32_is_torchs_to_rounding_and_strided_input_goes_to_torch():
    kernel = cpu_decode_attention.load()
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(4, 7, 576, generator=generator) * 3, torch.randn(576, generator=generator)
    got = kernel.rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, F.rms_norm(x, (576,), weight, 1e-5), rtol=2e-6, atol=1e-6)  # a summation order
    strided = x.transpose(0, 1)
    assert torch.equal(kernel.rms_norm(strided, weight, 1e-5), F.rms_norm(strided, (576,), weight, 1e-5))
    assert torch.equal(kernel.rms_norm(x, weight.bfloat16(), 1e-5), F.rms_norm(x, (576,), weight.bfloat16(), 1e-5))


@needs_gcc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups, heads, head_dim", [(3, 3, 64), (1, 2, 16)])
def test_prefill_rope_equals_the_torch_path(groups, heads, head_dim, dtype):
    """q, k, v in SDPA's layouts, k and v written at positions 0..L-1 of each prompt's slot, nothing else."""
    kernel = cpu_decode_attention.load()
    generator = torch.Generator().manual_seed(1)
    prompts, length, max_len, num_slots = 2, 7, 12, 4
    mixed = torch.randn(prompts, length, groups, heads + 2, head_dim, generator=generator).to(dtype)
    angles = torch.rand(length, head_dim // 2, generator=generator) * 3
    cos_sin = torch.stack([torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)],
                          dim=1).to(dtype)
    k_cache = torch.randn(num_slots, groups, max_len, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_slots, groups, max_len, head_dim, generator=generator).to(dtype)
    rtol, atol = (2 ** -8, 1e-5) if dtype == torch.bfloat16 else (1e-6, 1e-6)
    slots = torch.tensor([3, 1])
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    q, k, v = kernel.prefill_rope(mixed, cos_sin, k_cache, v_cache, slots)

    cos, sin = cos_sin.float()[:, None, None, 0], cos_sin.float()[:, None, None, 1]
    rotated = _rope(mixed.float()[..., :heads + 1, :], cos, sin)
    assert q.dtype == k.dtype == v.dtype == dtype
    torch.testing.assert_close(q.float(), rotated[..., :heads, :].flatten(2, 3).transpose(1, 2), rtol=rtol, atol=atol)
    torch.testing.assert_close(k.float(), rotated[..., heads, :].transpose(1, 2), rtol=rtol, atol=atol)
    assert torch.equal(v, mixed[..., heads + 1, :].transpose(1, 2))
    expected_k_cache[slots, :, :length] = k
    expected_v_cache[slots, :, :length] = v
    assert torch.equal(k_cache, expected_k_cache) and torch.equal(v_cache, expected_v_cache)
    assert kernel.prefill_rope(mixed.double(), cos_sin.double(), k_cache.double(), v_cache.double(), slots) is None
    # token-major (the packed attention kernel's layout): the same values, [P, L, heads, d], the same cache writes
    fresh_k, fresh_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    q_t, k_t, v_t = kernel.prefill_rope(mixed, cos_sin, fresh_k, fresh_v, slots, token_major=True)
    assert q_t.shape == (prompts, length, groups * heads, head_dim) and k_t.shape == (prompts, length, groups, head_dim)
    assert torch.equal(q_t, q.transpose(1, 2)) and torch.equal(k_t, k.transpose(1, 2))
    assert torch.equal(v_t, v.transpose(1, 2))
    assert torch.equal(fresh_k[slots, :, :length], k) and torch.equal(fresh_v[slots, :, :length], v)

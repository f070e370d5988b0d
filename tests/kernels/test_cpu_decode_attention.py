"""The fused CPU decode-attention kernel equals the torch decode path (RoPE, cache writes, GQA attention over
each slot's own positions), builds into a fresh cache folder, and falls back to None without a compiler."""

import shutil

import pytest
import torch

from rlhf.kernels import cpu_decode_attention
from rlhf.rollout.native.forward import _rope

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")


def _reference(mixed, cos_sin, k_cache, v_cache, positions, scale, cache_dtype=torch.float32):
    """What `Decoder._torch_attention` computes, on copies of the caches; the keys written are rounded to
    `cache_dtype` before attention reads them (as a cache of that dtype does)."""
    slots, groups, heads = mixed.shape[0], mixed.shape[1], mixed.shape[2] - 2
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    cos, sin = cos_sin[:, :, None, None, :].unbind(1)
    rotated = _rope(mixed[..., :heads + 1, :], cos, sin)
    slot_ids = torch.arange(slots)
    k_cache[slot_ids, :, positions] = rotated[:, :, heads].to(cache_dtype).to(k_cache.dtype)
    v_cache[slot_ids, :, positions] = mixed[:, :, heads + 1]
    context = int(positions.max()) + 1
    future = torch.arange(context)[None, :] > positions.repeat_interleave(groups)[:, None]
    mask = torch.where(future, float("-inf"), 0.0)[:, None, :]
    scores = torch.baddbmm(mask, rotated[:, :, :heads].flatten(0, 1),
                           k_cache[:slots].flatten(0, 1)[:, :context].transpose(1, 2), alpha=scale)
    attn = torch.bmm(torch.softmax(scores, dim=-1), v_cache[:slots].flatten(0, 1)[:, :context])
    return attn.reshape(slots, -1), k_cache, v_cache


@needs_gcc
@pytest.mark.parametrize("groups, heads, head_dim", [(2, 2, 16), (1, 4, 8), (3, 3, 64)])
def test_kernel_equals_the_torch_path(groups, heads, head_dim):
    kernel = cpu_decode_attention.load()
    assert kernel is not None
    inputs = _inputs(groups, heads, head_dim, torch.float32)
    expected, expected_k, expected_v = _reference(*inputs, head_dim ** -0.5)
    mixed, cos_sin, k_cache, v_cache, positions = inputs
    got = kernel(mixed, cos_sin, k_cache, v_cache, positions, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=1e-6)  # RoPE'd key written at each position
    assert torch.equal(v_cache, expected_v)  # value copied as is; every other cache entry untouched


@needs_gcc
@pytest.mark.parametrize("groups, heads, head_dim", [(2, 2, 16), (3, 3, 64)])
def test_bf16_kernel_is_the_fp32_math_rounded_to_bf16(groups, heads, head_dim):
    """bf16 tensors in and out, fp32 arithmetic: the fp32 reference on the same (bf16) inputs, rounded."""
    kernel = cpu_decode_attention.load()
    inputs = _inputs(groups, heads, head_dim, torch.bfloat16)
    expected, expected_k, expected_v = _reference(*(t.float() if t.is_floating_point() else t for t in inputs),
                                                  head_dim ** -0.5, cache_dtype=torch.bfloat16)
    mixed, cos_sin, k_cache, v_cache, positions = inputs
    got = kernel(mixed, cos_sin, k_cache, v_cache, positions, head_dim ** -0.5)
    assert got.dtype == k_cache.dtype == torch.bfloat16
    # within one bf16 rounding of the fp32 result (the kernel may fuse multiply-adds that torch rounds apart)
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -8, atol=1e-5)
    torch.testing.assert_close(k_cache.float(), expected_k, rtol=2 ** -8, atol=1e-6)
    assert torch.equal(v_cache.float(), expected_v)


def _clear_caches():
    cpu_decode_attention.load.cache_clear()
    cpu_decode_attention.library.cache_clear()


def _inputs(groups, heads, head_dim, dtype):
    """(mixed, cos_sin, k_cache, v_cache, positions): 5 slots of a 7-slot, 40-position cache."""
    gen = torch.Generator().manual_seed(head_dim)
    slots, cache_slots, max_len = 5, 7, 40
    mixed = torch.randn(slots, groups, heads + 2, head_dim, generator=gen)
    positions = torch.tensor([0, 39, 7, 1, 20])  # first position, last position, and some in between
    angles = torch.rand(slots, head_dim // 2, generator=gen) * 6
    cos_sin = torch.stack([torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)], 1)
    k_cache = torch.randn(cache_slots, groups, max_len, head_dim, generator=gen)
    v_cache = torch.randn(cache_slots, groups, max_len, head_dim, generator=gen)
    return (*(t.to(dtype) for t in (mixed, cos_sin, k_cache, v_cache)), positions)


@needs_gcc
def test_builds_into_a_fresh_cache_and_falls_back_without_a_compiler(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path))
    _clear_caches()
    try:
        assert cpu_decode_attention.load() is not None
        assert len(list(tmp_path.glob("kernels/*/cpu_decode_kernels.so"))) == 1
        # Built with -ffast-math but linked without it: loading it must not turn on flush-to-zero.
        assert float(torch.tensor(1e-40) * 1.0) > 0
        _clear_caches()
        monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "other"))
        monkeypatch.setenv("CC", "no-such-compiler")
        assert cpu_decode_attention.load() is None
        assert "kernels unavailable, using torch ops: no C compiler 'no-such-compiler' on PATH" in caplog.text
    finally:
        _clear_caches()


@needs_gcc
def test_an_unwritable_cache_folder_falls_back_to_a_temp_folder(tmp_path, monkeypatch):
    real_build = cpu_decode_attention._build

    def build(target):
        if str(target).startswith(str(tmp_path)):
            raise PermissionError(13, "Permission denied", str(target.parent))
        real_build(target)

    monkeypatch.setattr(cpu_decode_attention, "_build", build)
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "read-only"))
    _clear_caches()
    try:
        assert cpu_decode_attention.load() is not None
    finally:
        _clear_caches()

"""The CPU adapter for megatron-core: idempotent, scoped to megatron modules, torch's own factories untouched.

Runs in a fresh process (it patches process-wide state) via `run_distributed(..., backend="none")`.
"""

from __future__ import annotations

import shutil

import torch

from rlhf.testing.distributed import FakeGroup, run_distributed


def _probe() -> dict:
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mp_random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    from rlhf.platform.compat import megatron as megatron_compat

    original_zeros = torch.zeros
    megatron_compat.apply()
    megatron_compat.apply()
    torch.manual_seed(7)
    expected_state = torch.get_rng_state()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
        stream.record_event().synchronize()
    splits = dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    return {
        "moe_host_splits": (type(splits).__name__, splits.tolist()),
        "moe_gemm_torch_path": moe_utils.te_general_gemm is None,
        "torch_zeros_untouched": torch.zeros is original_zeros,
        "megatron_cuda_zeros_device": str(schedules.torch.zeros(2, device="cuda").device),
        "megatron_cuda_ordinal_device": str(schedules.torch.empty(2, device=0).device),
        "proxy_isinstance": isinstance(torch.ones(1), schedules.torch.Tensor),
        "type_name": torch.ones(1).type(),
        "type_conversion": torch.ones(1).type(torch.float64).dtype == torch.float64,
        "cuda_identity": (lambda t: t.cuda() is t)(torch.ones(1)),
        "rng_redirected": torch.equal(mp_random._get_cuda_rng_state(), expected_state),
        "current_device": str(torch.cuda.current_device()),
    }


def test_apply_adapts_megatron_only_and_is_idempotent():
    probe = run_distributed(_probe, 1, backend="none", timeout_s=120)[0]
    assert probe == {"moe_host_splits": ("ndarray", [3, 1]), "moe_gemm_torch_path": True,
                     "torch_zeros_untouched": True, "megatron_cuda_zeros_device": "cpu",
                     "megatron_cuda_ordinal_device": "cpu", "proxy_isinstance": True,
                     "type_name": "torch.cuda.FloatTensor", "type_conversion": True, "cuda_identity": True,
                     "rng_redirected": True, "current_device": "cpu"}


def _import_generation_after_compat() -> bool:
    from rlhf.platform.compat import megatron as megatron_compat

    megatron_compat.apply()
    import transformers.generation.continuous_batching.utils  # noqa: F401 - annotates with torch.cuda.Stream | None

    return isinstance(torch.cuda.Stream(), object) and (torch.cuda.Stream | None) is not None


def test_host_stream_is_a_type_so_later_imports_still_work():
    """Regression: a lambda for torch.cuda.Stream broke transformers' generation import (`Stream | None`)."""
    assert run_distributed(_import_generation_after_compat, 1, backend="none", timeout_s=300) == [True]


def _rope_probe() -> dict:
    from megatron.core.models.common.embeddings import rope_utils

    from rlhf.platform.compat import megatron as megatron_compat

    original = rope_utils._apply_rotary_pos_emb_bshd
    megatron_compat.apply()
    lean = rope_utils._apply_rotary_pos_emb_bshd
    generator = torch.Generator().manual_seed(0)
    out = {"patched": lean is not original}
    for case, (mscale, rotary_dim) in {"plain": (1.0, 16), "mscale": (1.5, 16), "partial": (1.0, 8)}.items():
        freqs = torch.randn(6, 1, 1, rotary_dim, generator=generator)
        for repeat in range(2):  # the second call reads the remembered cos/sin
            t = torch.randn(6, 2, 3, 16, generator=generator, requires_grad=True)
            upstream = torch.randn(6, 2, 3, 16, generator=generator)
            results = []
            for fn in (lean, original):
                y = fn(t, freqs, mscale=mscale)
                results.append((y, torch.autograd.grad((y * upstream).sum(), t)[0]))
            # full rotary goes to rlhf.platform.rope (the kernel library's rounding on CPU fp32); partial keeps
            # megatron's own function, bit for bit
            same = torch.equal if case == "partial" else (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-6))
            out[f"{case}{repeat}"] = all(same(a, b) for a, b in zip(*results))
    out.update(_thd_rope_probe(rope_utils, original, generator))
    return out



def _thd_rope_probe(rope_utils, original_bshd, generator: torch.Generator) -> dict:
    """Packed RoPE: the lean `_apply_rotary_pos_emb_thd` vs megatron's own per-sequence arithmetic (its
    `_get_thd_freqs_on_this_cp_rank` slices, then the original bshd), q and k of two layers, within fp32 rounding
    (`rlhf.platform.rope`'s kernel); the slices once."""
    out = {}
    lean_thd, slice_freqs = rope_utils._apply_rotary_pos_emb_thd, rope_utils._get_thd_freqs_on_this_cp_rank
    calls = []
    rope_utils._get_thd_freqs_on_this_cp_rank = lambda *args: calls.append(1) or slice_freqs(*args)
    try:
        for cp_size, cp_rank in ((1, 0), (2, 1)):
            cu = torch.tensor([0, 4, 12, 16], dtype=torch.int32)
            group = FakeGroup(cp_size, cp_rank)
            freqs = torch.randn(12, 1, 1, 16, generator=generator)
            seqlens = ((cu[1:] - cu[:-1]) // cp_size).tolist()
            calls.clear()
            same = []
            for _ in range(4):  # q and k of two layers
                t = torch.randn(16 // cp_size, 3, 16, generator=generator, requires_grad=True)
                upstream = torch.randn(t.shape, generator=generator)
                wanted = torch.cat([slice_freqs(cp_rank, cp_size, x, freqs) for x in torch.split(t, seqlens)])
                y = lean_thd(t, cu, freqs, cp_group=group)
                y_ref = original_bshd(t.unsqueeze(1), wanted).squeeze(1)
                grads = [torch.autograd.grad((out_ * upstream).sum(), t)[0] for out_ in (y, y_ref)]
                # THD packs rotate through `rlhf.platform.rope` (the kernel library's rounding on CPU fp32)
                same.append(torch.allclose(y, y_ref, rtol=0, atol=1e-6) and torch.allclose(*grads, rtol=0, atol=1e-6))
            out[f"thd_cp{cp_size}"] = all(same)
            nodes, todo = set(), [y.grad_fn]  # the rotation is rlhf.platform.rope's kernel where gcc builds it
            while todo:
                node = todo.pop()
                if node is not None and type(node).__name__ not in nodes:
                    nodes.add(type(node).__name__)
                    todo.extend(next_node for next_node, _ in node.next_functions)
            out[f"thd_cp{cp_size}_kernel"] = ("_RopeFunctionBackward" in nodes) == (shutil.which("gcc") is not None)
            out[f"thd_cp{cp_size}_slices"] = len(calls)  # once per sequence: one pack, four calls
    finally:
        rope_utils._get_thd_freqs_on_this_cp_rank = slice_freqs
    return out


def test_lean_rope_is_megatrons():
    probe = run_distributed(_rope_probe, 1, backend="none", timeout_s=120)[0]
    assert probe == {"patched": True, "plain0": True, "plain1": True, "mscale0": True, "mscale1": True,
                     "partial0": True, "partial1": True, "thd_cp1": True, "thd_cp1_slices": 3, "thd_cp2": True,
                     "thd_cp2_slices": 3, "thd_cp1_kernel": True, "thd_cp2_kernel": True}

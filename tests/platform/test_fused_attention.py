"""The fused attention core gives megatron's local core's outputs and gradients (causal, padded mask, GQA,
a one-token query), and is the core `build_gpt` puts in the local spec."""

from __future__ import annotations

import torch

from rlhf.testing.distributed import run_distributed
from tests.models.tiny import llama_config


def _rank() -> dict[str, float]:
    from rlhf.models.builder import build_gpt
    from rlhf.models.forward import padded_inputs
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.platform.fused_attention import FusedDotProductAttention
    from rlhf.platform.packed_attention import PackedDotProductAttention

    model = build_gpt(llama_config(), build_layout_groups(ParallelLayout(tp=1, pp=1, dp=1)))
    core = model.decoder.layers[0].self_attention.core_attention
    assert type(core) is FusedDotProductAttention
    generator = torch.Generator().manual_seed(0)
    seq, batch, heads, groups, dim = 12, 3, 4, 2, 16
    valid_bs = torch.ones(batch, seq, dtype=torch.bool)
    valid_bs[1, :4] = False  # left padding
    valid_bs[2, 9:] = False  # right padding
    cases = {"causal": (seq, None), "padded": (seq, padded_inputs(valid_bs)[1]), "one_query": (1, None)}
    errors = {}
    for name, (sq, mask) in cases.items():
        q = torch.randn(sq, batch, heads, dim, generator=generator, requires_grad=True)
        k, v = (torch.randn(sq, batch, groups, dim, generator=generator, requires_grad=True) for _ in range(2))
        upstream = torch.randn(sq, batch, heads * dim, generator=generator)
        results = []
        for forward in (FusedDotProductAttention.forward, PackedDotProductAttention.forward):
            out = forward(core, q, k, v, mask)
            grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
            results.append((out, *grads))
        errors[name] = max(float((a - b).abs().max()) for a, b in zip(*results))
    return errors


def test_fused_core_matches_megatrons_core():
    errors = run_distributed(_rank, 1, timeout_s=300)[0]
    assert set(errors) == {"causal", "padded", "one_query"}
    assert all(error < 1e-5 for error in errors.values()), errors

"""The packed (THD) attention core: sequences grouped into length buckets, each bucket one padded causal call,
equals attention over each sequence alone (outputs and gradients, GQA, a one-token sequence, a padded bucket)."""

from __future__ import annotations

import torch

from rlhf.platform.packed_attention import bucket_plan, length_buckets
from rlhf.testing.distributed import run_distributed
from tests.models.tiny import llama_config

LENGTHS = [7, 300, 1, 290, 40, 30]  # buckets [300], [290], [40, 30, 7, 1]: 10 + 33 + 39 padding slots


def test_length_buckets_group_similar_lengths_longest_first():
    assert length_buckets(LENGTHS) == [[1], [3], [4, 5, 0, 2]]
    assert length_buckets([64, 64, 1]) == [[0, 1, 2]]  # 64² - 1² <= BUCKET_WASTE
    assert length_buckets([100, 100, 10], waste=0) == [[0, 1], [2]]
    plan = bucket_plan((0, 3, 4, 6))  # lengths 3, 1, 2: one bucket of 3 rows x 3
    assert plan.shapes == ((3, 3),) and plan.sizes == (9,)
    assert plan.gather_p.tolist() == [0, 1, 2, 4, 5, 6, 3, 6, 6]  # 6: the padding row
    assert plan.gather_p[plan.scatter_t].tolist() == list(range(6))


def _rank() -> float:
    from rlhf.models.builder import build_gpt
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.platform.packed_attention import packed_seq_params

    groups = build_layout_groups(ParallelLayout())
    core = build_gpt(llama_config(), groups).decoder.layers[0].self_attention.core_attention
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, tokens = 4, 2, 16, sum(LENGTHS)
    q = torch.randn(tokens, heads, dim, generator=generator, requires_grad=True)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=generator, requires_grad=True) for _ in range(2))
    upstream = torch.randn(tokens, heads * dim, generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    packed = core(q, k, v, None, packed_seq_params=packed_seq_params(cu_seqlens, max(LENGTHS), groups.cp))
    alone = torch.cat([core(*(t[start:stop, None] for t in (q, k, v)), None)[:, 0]  # [s, 1, ...]: one sequence
                       for start, stop in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])
    results = [(out, *torch.autograd.grad((out * upstream).sum(), (q, k, v))) for out in (packed, alone)]
    return max(float((a - b).abs().max()) for a, b in zip(*results))


def test_packed_core_equals_each_sequence_alone():
    assert run_distributed(_rank, 1, timeout_s=300)[0] < 1e-6

"""The packed (THD) attention core: sequences grouped into length buckets, each bucket one padded causal call,
equals attention over each sequence alone (outputs and gradients, GQA, a one-token sequence, a padded bucket)."""

from __future__ import annotations

import pytest
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


def _rank(bucketed: bool) -> tuple[float, float]:
    """Largest difference between the packed core and megatron's core run on each sequence alone, and the larger of
    the two's differences from float64 (outputs and q/k/v gradients); `bucketed`: the flash path, not the kernel."""
    from rlhf.models.builder import build_gpt
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.platform import packed_attention
    from rlhf.platform.packed_attention import packed_seq_params

    if bucketed:
        packed_attention.kernel_applies = lambda *_: False
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
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact = _reference_attention(q64, k64, v64, cu_seqlens.tolist(), core.softmax_scale)
    exact = (exact, *torch.autograd.grad((exact * upstream.double()).sum(), (q64, k64, v64)))
    apart = max(float((a - b).abs().max()) for a, b in zip(*results))
    error = max(float((got.double() - want).abs().max()) for result in results for got, want in zip(result, exact))
    return apart, error


@pytest.mark.parametrize("bucketed", [False, True], ids=["kernel", "bucketed_flash"])
def test_packed_core_equals_each_sequence_alone(bucketed):
    apart, error = run_distributed(_rank, 1, bucketed, timeout_s=300)[0]
    assert apart < 3e-6 and error < 3e-6, (apart, error)  # fp32 rounding of sums over up to 300 keys


def _reference_attention(q_tnd: torch.Tensor, k_tnd: torch.Tensor, v_tnd: torch.Tensor, cu: list[int],
                         scale: float) -> torch.Tensor:
    """Masked softmax attention of every packed token over its own sequence's keys up to itself (GQA expanded)."""
    groups = q_tnd.shape[1] // k_tnd.shape[1]
    k_tnd, v_tnd = k_tnd.repeat_interleave(groups, dim=1), v_tnd.repeat_interleave(groups, dim=1)
    sequence_t = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    position_t = torch.arange(cu[-1])
    allowed_tt = (sequence_t[:, None] == sequence_t[None, :]) & (position_t[None, :] <= position_t[:, None])
    scores_htt = torch.einsum("qhd,khd->hqk", q_tnd, k_tnd) * scale
    probs_htt = scores_htt.masked_fill(~allowed_tt, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs_htt, v_tnd).reshape(cu[-1], -1)


def test_cp_chunk_core_equals_masked_attention_on_every_rank():
    """`attend_chunks` on each cp rank's queries and the (faked) rank-ordered K/V gather = masked attention over
    the whole pack, outputs and the gradients summed over ranks (odd lengths, a 1- and a 3-token sequence, GQA)."""
    from rlhf.platform.context_parallel import local_positions, padded_length
    from rlhf.platform.packed_attention import _offset_causal_mask, attend_chunks, chunk_buckets, cp_chunk_plan

    assert chunk_buckets([(4, 16), (2, 8), (4, 4), (1, 4)], waste=40) == [[0], [1], [2, 3]]
    assert chunk_buckets([(2, 16), (4, 15)], waste=1000) == [[0], [1]]  # more queries than the first: new group
    offsets = torch.tensor([3, 0])
    mask = _offset_causal_mask(offsets, 4, 7, torch.float32)  # queries last first: slot s is query 3 - s
    allowed = (torch.arange(7)[None, None, :] <= (3 - torch.arange(4))[None, :, None] + offsets[:, None, None])
    assert torch.equal(mask[:, 0] == 0, allowed) and mask.untyped_storage().nbytes() == 2 * (4 + 7 - 1) * 4
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, scale = 4, 2, 8, 0.3
    masked = set()
    for cp_size in (2, 3):
        lengths = [padded_length(n, cp_size) for n in (1, 3, 37, 300, 129, 90, 5)]
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        q = torch.randn(cu[-1], heads, dim, generator=generator, requires_grad=True)
        k, v = (torch.randn(cu[-1], kv_heads, dim, generator=generator, requires_grad=True) for _ in range(2))
        upstream = torch.randn(cu[-1], heads * dim, generator=generator)
        reference = _reference_attention(q, k, v, cu, scale)
        expected = torch.autograd.grad((reference * upstream).sum(), (q, k, v))
        local = [local_positions(torch.tensor(cu), cp_size, rank) for rank in range(cp_size)]
        kv_gnd = torch.cat([k, v], dim=1)[torch.cat(local)]  # rank 0's rows, then rank 1's, ...
        loss = 0
        for rank in range(cp_size):
            plan = cp_chunk_plan(tuple(cu), cp_size, rank)
            masked |= {bool(offsets.any()) for offsets in plan.offsets}
            out = attend_chunks(q[local[rank]], kv_gnd, kv_heads, plan, scale)
            torch.testing.assert_close(out, reference[local[rank]], atol=1e-6, rtol=0)
            loss = loss + (out * upstream[local[rank]]).sum()
        for grad, want in zip(torch.autograd.grad(loss, (q, k, v)), expected):
            torch.testing.assert_close(grad, want, atol=1e-5, rtol=0)
    assert masked == {True, False}  # buckets under the offset mask and top-left causal ones

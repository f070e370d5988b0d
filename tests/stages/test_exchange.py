"""The cross-mesh batch exchange on 4 gloo ranks: contributors' batches (different widths, dtypes, None fields)
arrive on every rank exactly as `concat_batches` of the originals, and no object is pickled on the way."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.parallel.layout import ParallelLayout
from rlhf.testing.distributed import run_distributed
from rlhf.stages.batch import RolloutBatch
from rlhf.stages.exchange import concat_batches, gather_global_batch, gather_rows, group_shard, is_contributor


def _batch(replica: int) -> RolloutBatch:
    """Replica `replica`'s rows: 2 prompts x 2 samples, widths growing with the replica."""
    gen = torch.Generator().manual_seed(replica)
    rows, seq, resp = 4, 5 + replica, 2 + replica
    mask = torch.rand(rows, resp, generator=gen) > 0.3
    return RolloutBatch(tokens_bs=torch.randint(0, 50, (rows, seq), generator=gen),
                        prompt_lengths_b=torch.full((rows,), 3), response_lengths_b=mask.sum(-1),
                        response_mask_bt=mask, loss_mask_bt=mask, group_index_b=torch.tensor([0, 0, 1, 1]),
                        sample_index_b=torch.tensor([0, 0, 1, 1]) + 10 * replica,
                        trajectory_index_b=torch.tensor([0, 1, 0, 1]),
                        rollout_logprobs_bt=-torch.rand(rows, resp, generator=gen),
                        policy_version_bt=mask.int() * replica, truncated_b=mask.all(-1),
                        scores_b=torch.rand(rows, generator=gen, dtype=torch.float32), baseline_scores_b=None,
                        reward_components_bk=torch.rand(rows, 3, generator=gen, dtype=torch.float32),
                        routed_experts_bslk=torch.randint(-1, 4, (rows, seq, 2, 2), generator=gen,
                                                          dtype=torch.int16),
                        pad_token_id=7)


def _refuse_pickle(*args, **kwargs):
    raise AssertionError("the exchange must not send pickled objects")


def _exchange() -> tuple[RolloutBatch, torch.Tensor, int]:
    dist.all_gather_object = dist.broadcast_object_list = _refuse_pickle
    layout = ParallelLayout(tp=2, dp=2)  # contributors: ranks 0 and 2 (tp rank 0 of each replica)
    rank = dist.get_rank()
    replica = layout.coords(rank).dp_rank
    contributes = is_contributor(layout, rank)
    batch = gather_global_batch(_batch(replica) if contributes else None, 2, layout)
    rows = gather_rows(torch.arange(3) + 10 * replica if contributes else None, layout)
    return batch, rows, int(contributes)


def test_global_batch_and_rows_without_pickle():
    want = concat_batches([_batch(0), _batch(1)], [2, 2])
    results = run_distributed(_exchange, 4, timeout_s=120)
    assert [contributes for _, _, contributes in results] == [1, 0, 1, 0]
    for batch, rows, _ in results:
        assert type(batch) is RolloutBatch and batch.pad_token_id == 7 and batch.baseline_scores_b is None
        for name in ("tokens_bs", "response_mask_bt", "loss_mask_bt", "group_index_b", "sample_index_b",
                     "rollout_logprobs_bt", "policy_version_bt", "truncated_b", "scores_b", "reward_components_bk",
                     "routed_experts_bslk"):
            got, expected = getattr(batch, name), getattr(want, name)
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
        assert batch.group_index_b.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert torch.equal(rows, torch.tensor([0, 1, 2, 10, 11, 12]))


def test_group_shards_concatenate_back_to_the_batch():
    """Async dynamic sampling: each rollout contributor sends a contiguous share of the filled batch's groups."""
    whole = concat_batches([_batch(0), _batch(1), _batch(2)], [2, 2, 2])  # 6 groups, widths padded to the widest
    for count in (1, 2, 3):
        shards = [group_shard(whole, index, count) for index in range(count)]
        assert [shard.group_index_b.tolist() for shard in shards][0] == [g for g in range(6 // count) for _ in "ab"]
        back = concat_batches(shards, [6 // count] * count)
        for name in ("tokens_bs", "response_mask_bt", "group_index_b", "rollout_logprobs_bt", "scores_b",
                     "routed_experts_bslk"):
            assert torch.equal(getattr(back, name), getattr(whole, name)), (count, name)

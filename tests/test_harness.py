"""The multi-process runner itself: results come back, errors and hangs fail fast with evidence."""

import time

import pytest
import torch
import torch.distributed as dist

from rlhf.testing.distributed import DistributedTestError, run_distributed


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def _rank0_hangs():
    if dist.get_rank() == 0:
        time.sleep(3600)
    return dist.get_rank()


def test_results_in_rank_order():
    assert run_distributed(_sum_ranks, 3, timeout_s=60) == [3.0, 3.0, 3.0]


def test_error_on_one_rank_fails_with_its_traceback():
    with pytest.raises(DistributedTestError, match="boom on rank 1"):
        run_distributed(_rank1_raises, 2, timeout_s=60)


def test_hang_fails_with_stacks():
    with pytest.raises(DistributedTestError, match=r"(?s)ranks \[0\] did not finish.*_rank0_hangs"):
        run_distributed(_rank0_hangs, 2, timeout_s=15)


def _tensor_result():
    return {"t": torch.arange(4.0) * dist.get_rank()}


def test_tensor_results_survive_the_rank_exiting():
    results = run_distributed(_tensor_result, 2, timeout_s=60)
    assert torch.equal(results[1]["t"], torch.arange(4.0))

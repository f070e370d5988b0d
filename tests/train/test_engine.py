"""TrainEngine on real gloo ranks: loss scaling over DP and micro-batches, TP parity, LR schedule, clipping,
non-finite policy, bitwise resume (plain and distributed optimizer) and offload/reload."""

from __future__ import annotations

import math

import pytest

from rlhf.testing.distributed import run_distributed
from tests.train.engine_world import engine_world


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(engine_world, 2, timeout_s=300)


@pytest.mark.parametrize("case", ["dp2_m2", "dp1_m2"])
def test_global_count_loss_is_invariant_to_dp_and_micro_batching(world, case):
    for rank_result in world:
        result = rank_result["loss_scaling"][case]
        assert result["loss"] > 1.0  # ~ln(96): a real NLL, not a zeroed one
        assert result["loss_diff"] < 1e-6
        assert result["norm_diff"] < 1e-6
        assert result["grad_diff"] < 1e-6


def test_tp2_matches_tp1(world):
    steps = world[0]["tp"]["steps"]
    assert steps[0][0] != steps[-1][0]  # the steps did move the weights
    for loss_tp1, loss_tp2, norm_tp1, norm_tp2 in steps:
        assert loss_tp2 == pytest.approx(loss_tp1, rel=1e-6)
        assert norm_tp2 == pytest.approx(norm_tp1, rel=1e-6)


def test_lr_warmup_then_cosine_then_min_lr(world):
    lr, min_lr, warmup, total = 1e-2, 1e-3, 2, 6
    expected = [lr * step / warmup for step in range(warmup + 1)]
    expected += [min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
                 for step in range(warmup + 1, total + 1)]
    expected += [min_lr]
    assert world[0]["schedule"]["lrs"] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_clipping_scales_grads_to_clip_norm(world):
    result = world[0]["clipping"]
    assert result["pre_clip_norm"] > 0.5
    assert result["used_norm"] == pytest.approx(0.05, rel=1e-5)


def test_nan_loss_is_skipped_without_touching_weights_optimizer_or_schedule(world):
    for rank_result in world:
        result = rank_result["non_finite"]
        assert not result["first_skipped"] and result["skipped"] and not result["after_skipped"]
        assert result["unchanged"]
        assert result["num_steps"] == 2
        # warmup over 3 steps: step 1 at 0, the skipped step and the next one both at lr/3
        assert result["lrs"] == pytest.approx([0.0, 1e-2 / 3, 1e-2 / 3])


def test_nan_loss_aborts_with_a_message_naming_role_and_step(world):
    for rank_result in world:
        assert rank_result["non_finite"]["message"] == (
            "critic train step 1: non-finite loss (loss=nan, grad_norm=nan); aborting as "
            "optim.nan_policy='abort' (set 'skip' to skip such steps)")


@pytest.mark.parametrize("case", ["resume_dp2_distopt", "resume_tp2"])
def test_resume_from_step_2_is_bitwise_exact(world, case):
    for rank_result in world:
        result = rank_result[case]
        assert result["changed"]
        assert result["weights_equal"] and result["losses_equal"] and result["lr_equal"]
        assert result["steps"] == (4, 4)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_offload_frees_storage_and_reload_is_bitwise(world, distributed_optimizer):
    for rank_result in world:
        result = rank_result["offload"][distributed_optimizer]
        assert result["freed"] and result["grads_freed"] and result["equal"]

"""TrainEngine and SFT on real gloo ranks: loss scaling over DP and micro-batches, TP/PP parity with one rank
and with transformers, forward_only, LR schedule, clipping, non-finite policy, bitwise resume (plain and
distributed optimizer), offload/reload. One 2-rank world computes everything; tests assert on its results."""

from __future__ import annotations

import math

import pytest

from rlhf.testing.distributed import run_distributed
from tests.train.engine_world import engine_world
from tests.train.helpers import save_tiny_llama


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    path = save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))
    return run_distributed(engine_world, 2, path, timeout_s=300)


@pytest.mark.parametrize("case", ["dp2_m2", "dp1_m2", "dp2_distopt"])
def test_global_count_loss_is_invariant_to_dp_and_micro_batching(world, case):
    for rank_result in world:
        result = rank_result["loss_scaling"][case]
        assert result["loss"] > 4.0  # ~ln(101) at init: a real NLL
        assert result["loss_diff"] < 1e-6
        assert result["norm_diff"] < 1e-6
        assert result["grad_diff"] < 1e-6


def test_distributed_optimizer_steps_like_the_plain_one(world):
    for rank_result in world:
        assert rank_result["loss_scaling"]["distopt_weight_diff"] < 1e-6


@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2_distopt", "pp2_distopt"])
def test_layouts_match_one_rank_and_transformers(world, layout):
    for rank_result in world:
        result = rank_result["layouts"]
        assert result[layout][0][0] == pytest.approx(result["hf_loss"], abs=1e-5)
        assert result["single"][0][0] == pytest.approx(result["hf_loss"], abs=1e-5)
        assert result["single"][2][0] < result["single"][0][0] - 0.1  # the steps did train
        for (loss, norm), (ref_loss, ref_norm) in zip(result[layout], result["single"]):
            assert loss == pytest.approx(ref_loss, abs=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)


def test_forward_only_logprobs_match_transformers(world):
    first_stage, last_stage = world[0]["forward_only"]["pp2"], world[1]["forward_only"]["pp2"]
    assert first_stage["count"] == 0 and first_stage["diff"] is None
    assert last_stage["count"] == 2 and last_stage["diff"] < 1e-5
    for rank_result in world:
        assert rank_result["forward_only"]["tp2"]["count"] == 2
        assert rank_result["forward_only"]["tp2"]["diff"] < 1e-5


def test_sft_steps_reduce_the_answer_nll(world):
    losses = world[0]["sft_learns"]["losses"]
    assert losses[0] > 4.0 and losses[-1] < 0.6 * losses[0]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))
    assert world[1]["sft_learns"]["losses"] == losses  # every DP rank reports the global loss


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_critic_value_steps_match_one_rank(world, layout):
    for rank_result in world:
        result = rank_result["critic"]
        assert result["single"]["steps"][2][0] < result["single"]["steps"][0][0]
        for (loss, norm), (ref_loss, ref_norm) in zip(result[layout]["steps"], result["single"]["steps"]):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)
        if result[layout]["values"] is not None:  # the last pipeline stage
            assert result[layout]["values"] == pytest.approx(result["single"]["values"], abs=1e-5)
    assert world[0]["critic"]["pp2"]["values"] is None and world[1]["critic"]["pp2"]["values"] is not None


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
        assert rank_result["non_finite"]["grad_message"].startswith(
            "critic train step 1: non-finite gradient norm (loss=4.")
        assert rank_result["non_finite"]["grad_message"].endswith(
            ", grad_norm=nan); aborting as optim.nan_policy='abort' (set 'skip' to skip such steps)")


def test_nan_gradient_with_finite_loss_is_skipped(world):
    for rank_result in world:
        assert rank_result["non_finite"]["grad_skip"] == (True, True, True)


@pytest.mark.parametrize("case", ["resume_dp2_distopt", "resume_pp2"])
def test_resume_from_step_2_is_bitwise_exact(world, case):
    for rank_result in world:
        result = rank_result[case]
        assert result["changed"]
        assert result["weights_equal"] and result["losses_equal"] and result["lr_equal"]
        assert result["steps"] == (4, 4)


@pytest.mark.parametrize("case", ["dp2->single", "tp2->dp2", "pp2->tp2"])
def test_resume_on_another_layout_continues_within_fp32_tolerance(world, case):
    """DP2 (Adam shards) -> one rank, TP2 -> DP2 (sharded again), PP2 -> TP2: the next steps' losses match."""
    for rank_result in world:
        result = rank_result["reshard"][case]
        expected, resumed = result["losses"]
        assert result["changed"] and result["lr_equal"]
        assert resumed == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_offload_frees_storage_and_reload_is_bitwise(world, distributed_optimizer):
    for rank_result in world:
        result = rank_result["offload"][distributed_optimizer]
        assert result["freed"] and result["grads_freed"] and result["equal"]
        assert result["keep_params"] == {"params_resident": True, "state_freed": True, "grads_freed": True,
                                         "equal": True}

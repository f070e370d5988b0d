"""One-step-off async RL on split placement (rollout on rank 1, actor on rank 0): the rollout samples each batch
with the policy one update behind (k behind at max_staleness=k), every token records its version, partial
rollouts continue rows across a weight push, and a resume with a batch in flight (or a started one) reproduces
the uninterrupted run exactly; configs that cannot overlap are refused."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer, trainer_config  # noqa: E402

from rlhf.errors import ConfigError  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402

SPLIT = ["mesh.placement=split", "mesh.actor={ranks: [0, 1]}", "mesh.rollout={ranks: [1, 2]}", "run.name=r",
         "actor.optim.lr=0.05", "trainer.val_before_train=false", "checkpoint.every=2"]
# comm.verify: layout fingerprints on the metric reduction, and every weight push checksummed against the actor
ASYNC = SPLIT + ["trainer.async_mode=one_step_off", "comm.verify=true"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_val=4)


def _runs(paths, root):
    reward = Path(root) / "length_reward.py"  # a dense signal, so each update moves the weights
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    common = ["reward.by_source={}", f"reward.function={reward}:score"]
    sync = run_trainer(paths, f"{root}/sync", SPLIT + common + ["trainer.total_steps=2"])
    full = run_trainer(paths, f"{root}/full", ASYNC + common + ["trainer.total_steps=4"])
    run_trainer(paths, f"{root}/split", ASYNC + common + ["trainer.total_steps=2"])
    resumed = run_trainer(paths, f"{root}/split", ASYNC + common + ["trainer.total_steps=4"])
    two_off = run_trainer(paths, f"{root}/two", ASYNC + common + ["trainer.total_steps=3", "trainer.max_staleness=2",
                                                                  "checkpoint.every=0"])
    partial = ASYNC + common + ["trainer.max_staleness=2", "trainer.partial_rollout_tokens=2", "run.name=p"]
    partial_full = run_trainer(paths, f"{root}/partial_full", partial + ["trainer.total_steps=4"])
    run_trainer(paths, f"{root}/partial", partial + ["trainer.total_steps=2"])
    partial_resumed = run_trainer(paths, f"{root}/partial", partial + ["trainer.total_steps=4"])
    return sync, full, resumed, two_off, partial_full, partial_resumed


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/throughput", "memory/"))}


def test_one_step_off_samples_one_version_behind_and_resumes_with_the_batch_in_flight(tiny, tmp_path):
    sync, full, resumed, two_off, partial_full, partial_resumed = run_distributed(_runs, 2, tiny, str(tmp_path),
                                                                               timeout_s=600)[0]
    # Step 1 trains on the batch both modes sample from the initial policy with step 1's seed: identical.
    assert _comparable(full[0]) == _comparable(sync[0])
    assert [row["rollout/staleness_max"] for row in full] == [0.0, 1.0, 1.0, 1.0]
    assert [row["rollout/staleness_mean"] for row in full] == [0.0, 1.0, 1.0, 1.0]
    assert sync[1]["rollout/staleness_max"] == 0.0
    assert [row["rollout/staleness_max"] for row in two_off] == [0.0, 1.0, 2.0]  # k-step-off: k batches ahead
    # From step 2 the rollout sampled with the weights before the last update; the actor's recomputed old
    # logprobs see the difference (synchronous: one rounding apart), and token TIS reweights it.
    assert sync[1]["rollout/logprob_diff_max"] < 1e-5
    assert all(row["rollout/logprob_diff_max"] > 1e-3 for row in full[1:])
    spread = [row["rollout_corr/is_weight_max"] - row["rollout_corr/is_weight_min"] for row in (sync[1], full[1])]
    assert spread[0] < 1e-4 < 1e-3 < spread[1], spread
    # The checkpoint at step 2 holds batch 3 (generated during step 2), so the resumed run is the same run.
    assert [row["step"] for row in resumed] == [3, 4]
    assert [_comparable(r) for r in full[2:]] == [_comparable(r) for r in resumed]
    step_2 = tmp_path / "split/r/checkpoints/step_2"
    assert (step_2 / "async_in_flight.safetensors").is_file()
    assert "val/score/mean@1" in full[-1]
    # Partial rollouts (2 tokens per row, then the rest after the next push): from step 3 a batch mixes tokens
    # two and one versions behind; the checkpoint holds the started batch, so the resume is exact again.
    assert [row["rollout/staleness_max"] for row in partial_full] == [0.0, 1.0, 2.0, 2.0]
    assert all(1.0 < row["rollout/staleness_mean"] < 2.0 for row in partial_full[2:])
    assert [_comparable(r) for r in partial_full[2:]] == [_comparable(r) for r in partial_resumed]
    from rlhf.state_file import decode_state

    rollout_state = decode_state((tmp_path / "partial/p/checkpoints/step_2/rank1.safetensors").read_bytes(), "rank1")
    assert rollout_state["async"]["started"]["index"] == 4  # batch 3 was exchanged at step 2; batch 4 began


def _check(tiny, tmp_path, overrides):
    from rlhf.orchestration.preflight import check_layouts

    check_layouts(trainer_config(tiny, str(tmp_path), overrides), 2)


def test_async_configs_that_cannot_overlap_are_refused(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"^trainer\.async_mode=one_step_off needs mesh\.placement=split: "
                                          r"colocated ranks generate and train one after the other"):
        _check(tiny, tmp_path, ["trainer.async_mode=one_step_off"])
    with pytest.raises(ConfigError, match=r"^trainer\.async_mode=one_step_off needs the rollout on ranks of its "
                                          r"own, but mesh\.actor also uses ranks 0\.\.1 of mesh\.rollout\.ranks="
                                          r"\[0, 2\]"):
        _check(tiny, tmp_path, ["trainer.async_mode=one_step_off", "mesh.placement=split",
                                "mesh.actor={ranks: [0, 2]}", "mesh.rollout={ranks: [0, 2]}"])
    with pytest.raises(ConfigError, match=r"algo\.filter_groups\.enable=true yet"):
        _check(tiny, tmp_path, ASYNC + ["algo.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match=r"set actor\.recompute_old_logprobs=true"):
        _check(tiny, tmp_path, ASYNC + ["actor.recompute_old_logprobs=false", "algo.rollout_correction.enable=false"])
    with pytest.raises(ConfigError, match=r"^trainer\.max_staleness=0 must be >= 1"):
        _check(tiny, tmp_path, ASYNC + ["trainer.max_staleness=0"])
    with pytest.raises(ConfigError, match=r"^trainer\.partial_rollout_tokens=2 continues rows after a weight push.*"
                                          r"needs trainer\.async_mode=one_step_off with trainer\.max_staleness >= 2 "
                                          r"\(got one_step_off, 1\)"):
        _check(tiny, tmp_path, ASYNC + ["trainer.partial_rollout_tokens=2"])
    with pytest.raises(ConfigError, match=r"must be below sampling\.max_new_tokens=5"):
        _check(tiny, tmp_path, ASYNC + ["trainer.partial_rollout_tokens=5", "trainer.max_staleness=2"])
    _check(tiny, tmp_path, ASYNC)
    _check(tiny, tmp_path, ASYNC + ["trainer.partial_rollout_tokens=2", "trainer.max_staleness=2"])


def _four_rank_runs(paths, root):
    common = ["mesh.placement=split", "trainer.async_mode=one_step_off", "trainer.val_before_train=false",
              "comm.verify=true"]
    ppo = run_trainer(paths, f"{root}/ppo", common + [
        "mesh.actor={tp: 2, ranks: [0, 2]}", "mesh.critic={ranks: [0, 2]}", "mesh.ref={ranks: [0, 2]}",
        "mesh.rollout={ranks: [2, 4]}", "algo.advantage.kind=gae", "algo.kl.coef=0.05", "algo.kl.in_reward=true",
        "actor.epochs=2", "actor.mini_batches=2", "trainer.total_steps=3", "run.name=ppo"])
    grpo = common + ["mesh.actor={ranks: [0, 2]}", "mesh.rollout={tp: 2, ranks: [2, 4]}", "actor.optim.lr=0.05",
                     "checkpoint.every=2", "run.name=g"]
    full = run_trainer(paths, f"{root}/full", grpo + ["trainer.total_steps=4"])
    run_trainer(paths, f"{root}/split", grpo + ["trainer.total_steps=2"])
    resumed = run_trainer(paths, f"{root}/split", grpo + ["trainer.total_steps=4"])
    return ppo, full, resumed


@pytest.mark.slow
def test_async_ppo_and_grpo_resume_on_4_ranks(tiny, tmp_path):
    """2 training ranks (actor tp2 + critic + ref, or actor dp2) beside 2 rollout ranks (dp2, or tp2)."""
    results = run_distributed(_four_rank_runs, 4, tiny, str(tmp_path), timeout_s=900)
    assert results[3] == results[0], "every rank sees the same reduced metrics"
    ppo, full, resumed = results[0]
    assert [row["rollout/staleness_max"] for row in ppo] == [0.0, 1.0, 1.0]
    for key in ("critic/vf_loss", "critic/vf_explained_var", "actor/reward_kl_penalty", "timing_s/update_critic",
                "timing_s/gen", "actor/pg_loss"):
        assert all(key in row for row in ppo), key
    assert [row["step"] for row in resumed] == [3, 4]
    assert [_comparable(r) for r in full[2:]] == [_comparable(r) for r in resumed]


def test_an_in_flight_batch_round_trips_bitwise_and_a_foreign_one_is_refused():
    import dataclasses

    import torch

    from rlhf.errors import CheckpointError
    from rlhf.state_file import decode_state, encode_state
    from rlhf.orchestration.async_schedule import batch_from_state, batch_state
    from rlhf.trainer.batch import TrainBatch

    mask_bt = torch.tensor([[True, True, False], [True, False, False]])
    batch = TrainBatch(tokens_bs=torch.randint(0, 50, (2, 7)), prompt_lengths_b=torch.tensor([4, 4]),
                       response_lengths_b=torch.tensor([2, 1]), response_mask_bt=mask_bt,
                       group_index_b=torch.tensor([0, 0]), rollout_logprobs_bt=-torch.rand(2, 3) * mask_bt,
                       policy_version_bt=mask_bt.int() * 7, scores_b=torch.tensor([1.0, 0.0]), pad_token_id=3)
    back = batch_from_state(decode_state(encode_state(batch_state(batch)), "in-flight batch"))
    for field in dataclasses.fields(TrainBatch):
        mine, theirs = getattr(batch, field.name), getattr(back, field.name)
        if isinstance(mine, torch.Tensor):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), field.name
        else:
            assert mine == theirs, field.name
    foreign = batch_state(batch) | {"routing_bt": None}
    with pytest.raises(CheckpointError, match=r"^the checkpoint's in-flight batch has fields \['routing_bt'\] this "
                                              r"version does not expect"):
        batch_from_state(foreign)


def test_partial_rollouts_join_each_row_with_its_continuation_token_by_token():
    import torch

    from rlhf.rollout.types import FinishReason, Rollouts
    from rlhf.orchestration.partial_rollout import merge_rollouts

    first = Rollouts(response_tokens_rt=torch.tensor([[5, 0], [6, 7]]),
                     response_logprobs_rt=torch.tensor([[-0.5, 0.0], [-0.6, -0.7]]),
                     response_scaled_logprobs_rt=torch.tensor([[-0.4, 0.0], [-0.5, -0.6]]),
                     response_lengths_r=torch.tensor([1, 2]), finish_reasons=[FinishReason.STOP, FinishReason.LENGTH],
                     prompt_index_r=torch.tensor([0, 0]), policy_version=3)
    rest = Rollouts(response_tokens_rt=torch.tensor([[8, 9, 0]]),
                    response_logprobs_rt=torch.tensor([[-0.8, -0.9, 0.0]]),
                    response_scaled_logprobs_rt=torch.tensor([[-0.7, -0.8, 0.0]]), response_lengths_r=torch.tensor([2]),
                    finish_reasons=[FinishReason.STOP], prompt_index_r=torch.tensor([0]), policy_version=4)
    merged, versions_rt = merge_rollouts(first, rest, running=[1], width=5)
    assert merged.response_tokens_rt.tolist() == [[5, 0, 0, 0, 0], [6, 7, 8, 9, 0]]
    assert merged.response_lengths_r.tolist() == [1, 4]
    assert merged.response_logprobs_rt[1].tolist() == torch.tensor([-0.6, -0.7, -0.8, -0.9, 0.0]).tolist()
    assert merged.response_scaled_logprobs_rt[1, :4].tolist() == torch.tensor([-0.5, -0.6, -0.7, -0.8]).tolist()
    assert versions_rt.tolist() == [[3, 0, 0, 0, 0], [3, 3, 4, 4, 0]]
    assert merged.finish_reasons == [FinishReason.STOP, FinishReason.STOP]

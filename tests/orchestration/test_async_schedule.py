"""One-step-off async RL on split placement (rollout on rank 1, actor on rank 0): the rollout samples each batch
with the policy one update behind (k behind at max_staleness=k), every token records its version, partial
rollouts continue rows across a weight push, and a resume with a batch in flight (or a started one) reproduces
the uninterrupted run exactly; configs that cannot overlap are refused."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, rollout_batch, run_trainer, trainer_config  # noqa: E402

from rlhf.errors import ConfigError  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402

SPLIT = ["mesh.placement=split", "mesh.actor={ranks: [0, 1]}", "mesh.rollout={ranks: [1, 2]}", "run.name=r",
         "actor.optim.lr=0.05", "trainer.val_before_train=false", "checkpoint.every=2"]
# comm.verify: layout fingerprints on the metric reduction, and every weight push checksummed against the actor
ASYNC = SPLIT + ["trainer.async_mode=one_step_off", "comm.verify=true"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_val=4)


def _recorded_run(paths, root, overrides):
    """A trainer run that also returns the batch of every actor update (on its ranks) and the prompt batches
    this rank's loader gave out."""
    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight
    from rlhf.run_dir import close_run, setup_run

    import torch.distributed as dist

    cfg = trainer_config(paths, root, overrides)
    preflight(cfg, dist.get_world_size())
    run_dir = setup_run(cfg.run, cfg, defer_config=True)
    try:
        trainer, batches = Trainer(cfg, run_dir), []
        trainer.scored_hooks.append(lambda batch, step: batches.append(batch))
        history = trainer.fit()
        return {"history": history, "batches": batches, "consumed": trainer.loader.sampler.consumed_batches}
    finally:
        close_run()


def _runs(paths, root):
    rewards = Path(root) / "rewards.py"
    rewards.write_text("def length(data_source, solution, ground_truth, extra_info):\n"  # dense: updates move
                       "    return float(len(solution) % 2)\n"
                       "def odd_only(data_source, solution, ground_truth, extra_info):\n"  # even answers: all 0
                       "    return float(len(solution) % 2) if int(ground_truth) % 2 else 0.0\n")
    common = ["reward.by_source={}", f"reward.function={rewards}:length"]
    sync = run_trainer(paths, f"{root}/sync", SPLIT + common + ["trainer.total_steps=2"])
    dumped = ASYNC + common + ["trainer.dump_rollouts=true"]
    full = _recorded_run(paths, f"{root}/full", dumped + ["trainer.total_steps=4"])
    run_trainer(paths, f"{root}/split", dumped + ["trainer.total_steps=2"])
    resumed = run_trainer(paths, f"{root}/split", dumped + ["trainer.total_steps=4"])
    two_off = run_trainer(paths, f"{root}/two", ASYNC + common + ["trainer.total_steps=3", "trainer.max_staleness=2",
                                                                  "checkpoint.every=0"])
    partial = ASYNC + common + ["trainer.max_staleness=2", "trainer.partial_rollout_tokens=2", "run.name=p"]
    partial_full = run_trainer(paths, f"{root}/partial_full", partial + ["trainer.total_steps=4",
                                                                         "trainer.dump_rollouts=true"])
    run_trainer(paths, f"{root}/partial", partial + ["trainer.total_steps=2"])
    partial_resumed = run_trainer(paths, f"{root}/partial", partial + ["trainer.total_steps=4"])
    # DAPO dynamic sampling: groups of an even answer all score 0 and are dropped; up to 3 rounds per batch
    sampling = ["reward.by_source={}", f"reward.function={rewards}:odd_only", "algo.filter_groups.enable=true",
                "algo.filter_groups.max_num_gen_batches=3", "trainer.val_every=0", "run.name=ds"]
    ds_sync = _recorded_run(paths, f"{root}/ds_sync", SPLIT + sampling + ["trainer.total_steps=1"])
    ds_full = _recorded_run(paths, f"{root}/ds_full", ASYNC + sampling + ["trainer.total_steps=4"])
    _recorded_run(paths, f"{root}/ds", ASYNC + sampling + ["trainer.total_steps=2"])
    ds_resumed = _recorded_run(paths, f"{root}/ds", ASYNC + sampling + ["trainer.total_steps=4"])
    # ... with partial rollouts: a batch's first round is started a step early, its extra rounds run whole
    dsp = ASYNC + sampling + ["trainer.max_staleness=2", "trainer.partial_rollout_tokens=2", "run.name=dsp"]
    dsp_full = _recorded_run(paths, f"{root}/dsp_full", dsp + ["trainer.total_steps=4"])
    _recorded_run(paths, f"{root}/dsp", dsp + ["trainer.total_steps=2"])
    dsp_resumed = _recorded_run(paths, f"{root}/dsp", dsp + ["trainer.total_steps=4"])
    return {"sync": sync, "full": full, "resumed": resumed, "two_off": two_off, "partial_full": partial_full,
            "partial_resumed": partial_resumed, "ds_sync": ds_sync, "ds_full": ds_full, "ds_resumed": ds_resumed,
            "dsp_full": dsp_full, "dsp_resumed": dsp_resumed}


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory):
    """Every 2-rank run of this file in one launched world: per rank, the runs' results."""
    root = tmp_path_factory.mktemp("async")
    return root, run_distributed(_runs, 2, tiny, str(root), timeout_s=600)


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/throughput", "memory/"))}


def test_one_step_off_samples_one_version_behind_and_resumes_with_the_batch_in_flight(world):
    tmp_path, ranks = world
    runs = ranks[0]
    sync, full, resumed, two_off = runs["sync"], runs["full"]["history"], runs["resumed"], runs["two_off"]
    partial_full, partial_resumed = runs["partial_full"], runs["partial_resumed"]
def test_dynamic_sampling_rounds_run_on_the_rollout_rank_and_resume_with_the_batch_in_flight(world):
    ranks = world[1]
    trainer, rollout = ranks[0], ranks[1]
    sync, full, resumed = trainer["ds_sync"], trainer["ds_full"], trainer["ds_resumed"]
    # Batch 1 (sampled by v0 in both modes): the same rounds (seeds, loader batches), the same filled batch.
    trained = [{k: v for k, v in _comparable(run["history"][0]).items() if not k.startswith("val/")}
               for run in (full, sync)]  # the 1-step run validates at its end
    assert trained[0] == trained[1]
    first, again = sync["batches"][0], full["batches"][0]
    for name, value in vars(first).items():
        theirs = getattr(again, name)
        assert torch.equal(value, theirs) if isinstance(value, torch.Tensor) else value == theirs, name
    rounds = [row["dynamic_sampling/gen_rounds"] for row in full["history"]]
    assert max(rounds) > 1 and sum(row["dynamic_sampling/dropped_groups"] for row in full["history"]) > 0
    for row, batch in zip(full["history"], full["batches"]):
        assert row["dynamic_sampling/kept_groups"] + row["dynamic_sampling/filled_groups"] == 4
        assert batch.size == 4 * 4 and int(batch.group_index_b.max()) == 3
    # The rounds are decided by the rollout rank alone: its loader gave out every round of batches 1..5 (batch 5
    # is in flight after step 4); the trainer's loader gave out nothing.
    assert trainer["ds_full"]["consumed"] == 0 and rollout["ds_full"]["consumed"] > sum(rounds)
    assert rollout["ds_sync"]["consumed"] == trainer["ds_sync"]["consumed"] == rounds[0]
    # Resumed from step 2 (batch 3 in flight, its rounds' metrics held by the rollout rank): the same run.
    assert [row["step"] for row in resumed["history"]] == [3, 4]
    assert [_comparable(r) for r in full["history"][2:]] == [_comparable(r) for r in resumed["history"]]
    assert rollout["ds_resumed"]["consumed"] == rollout["ds_full"]["consumed"]


def test_dynamic_sampling_with_partial_rollouts_fills_batches_of_two_versions_and_resumes(world):
    ranks = world[1]
    trainer, rollout = ranks[0], ranks[1]
    full, resumed = trainer["dsp_full"], trainer["dsp_resumed"]
    rounds = [row["dynamic_sampling/gen_rounds"] for row in full["history"]]
    assert max(rounds) > 1
    mixed = 0
    for step, (row, batch) in enumerate(zip(full["history"], full["batches"]), start=1):
        assert row["dynamic_sampling/kept_groups"] + row["dynamic_sampling/filled_groups"] == 4
        assert batch.size == 4 * 4 and int(batch.group_index_b.max()) == 3
        versions = batch.policy_version_bt[batch.response_mask_bt.bool()]
        assert int(versions.max()) <= step - 1 and row["rollout/staleness_max"] <= 2
        mixed += int(versions.max()) > int(versions.min())  # the started round's tokens span a weight push
    assert mixed > 0
    # Resumed from step 2 (a batch in flight and one started): the same rounds, batches and metrics.
    assert [row["step"] for row in resumed["history"]] == [3, 4]
    assert [_comparable(r) for r in full["history"][2:]] == [_comparable(r) for r in resumed["history"]]
    for mine, theirs in zip(full["batches"][2:], resumed["batches"]):
        assert torch.equal(mine.tokens_bs, theirs.tokens_bs)
        assert torch.equal(mine.policy_version_bt, theirs.policy_version_bt)
    assert rollout["dsp_resumed"]["consumed"] == rollout["dsp_full"]["consumed"]


def _dumps(folder):
    import pyarrow.parquet as pq

    return [pq.read_table(path).to_pylist() for path in sorted(folder.glob("step_*.parquet"))]


def test_async_dumps_every_trained_batch_once_under_the_step_that_trains_it(world):
    from rlhf.orchestration.rollout_dump import dump_path, read_dump

    root, ranks = world
    full = ranks[0]["full"]
    folder = root / "full/r/rollouts"
    assert sorted(path.name for path in folder.iterdir()) == [dump_path(folder, step).name for step in (1, 2, 3, 4)]
    for step, (rows, trained) in enumerate(zip(_dumps(folder), full["batches"]), start=1):
        assert {row["step"] for row in rows} == {step}
        assert {v for row in rows for v in row["policy_version"]} == {max(0, step - 2)}  # sampled one update behind
        assert {v for row in rows for v in row["staleness"]} == {min(step - 1, 1)}
        back = read_dump(dump_path(folder, step), vocab_size=18, max_positions=64)
        assert torch.equal(back.tokens_bs, trained.tokens_bs[:, :back.tokens_bs.shape[1]])
        for name in ("scores_b", "group_index_b", "sample_index_b", "response_lengths_b"):
            assert torch.equal(getattr(back, name), getattr(trained, name)), name
        assert [row["advantages"] for row in rows] == [trained.advantages_bt[i, :n].tolist()
                                                        for i, n in enumerate(trained.response_lengths_b.tolist())]
    # The resumed run (batch 3 was in flight in the step-2 checkpoint) dumped steps 3 and 4 once, as the full run.
    assert _dumps(root / "split/r/rollouts") == _dumps(folder)
    # Partial rollouts: one row holds tokens of two versions (the rows still running at the push), per token.
    partial = _dumps(root / "partial_full/p/rollouts")
    assert len(partial) == 4
    mixed = [row for row in partial[3] if len(set(row["policy_version"])) == 2]
    assert mixed and all(row["policy_version"][:2] == [1, 1] and set(row["policy_version"][2:]) == {2}
                         and row["staleness"][:2] == [2, 2] for row in mixed)


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
    with pytest.raises(ConfigError, match=r"^trainer\.async_mode=one_step_off trains on rollouts of an older policy, "
                                          r"so the ratio needs old logprobs, which actor\.recompute_old_logprobs="
                                          r"false skips: set it to auto or true"):
        _check(tiny, tmp_path, ASYNC + ["actor.recompute_old_logprobs=false", "algo.rollout_correction.enable=false"])
    _check(tiny, tmp_path, ASYNC + ["algo.rollout_correction.enable=false"])  # auto: the forward runs (below)
    with pytest.raises(ConfigError, match=r"^trainer\.max_staleness=0 must be >= 1"):
        _check(tiny, tmp_path, ASYNC + ["trainer.max_staleness=0"])
    with pytest.raises(ConfigError, match=r"^trainer\.partial_rollout_tokens=2 continues rows after a weight push.*"
                                          r"needs trainer\.async_mode=one_step_off with trainer\.max_staleness >= 2 "
                                          r"\(got one_step_off, 1\)"):
        _check(tiny, tmp_path, ASYNC + ["trainer.partial_rollout_tokens=2"])
    with pytest.raises(ConfigError, match=r"must be below sampling\.max_new_tokens=5"):
        _check(tiny, tmp_path, ASYNC + ["trainer.partial_rollout_tokens=5", "trainer.max_staleness=2"])
    with pytest.raises(ConfigError, match=r"^trainer\.partial_rollout_tokens=2 runs with the native or vllm engine "
                                          r"and without ReMax's greedy baseline only yet \(rollout\.engine=hf, "):
        _check(tiny, tmp_path, ASYNC + ["trainer.partial_rollout_tokens=2", "trainer.max_staleness=2",
                                        "rollout.engine=hf"])
    _check(tiny, tmp_path, ASYNC)
    _check(tiny, tmp_path, ASYNC + ["algo.filter_groups.enable=true"])
    _check(tiny, tmp_path, ASYNC + ["algo.filter_groups.enable=true", "trainer.partial_rollout_tokens=2",
                                    "trainer.max_staleness=2"])
    _check(tiny, tmp_path, ASYNC + ["trainer.partial_rollout_tokens=2", "trainer.max_staleness=2"])
    _check(tiny, tmp_path, ASYNC + ["trainer.partial_rollout_tokens=2", "trainer.max_staleness=2",
                                    "rollout.engine=vllm"])


def test_async_auto_runs_the_old_logprob_forward():
    """Without rollout correction or KL in the reward, a strictly on-policy update skips the old-logprob forward
    (its own detached logprobs are the old ones); a stale (async) batch must not: the ratio would be 1."""
    from rlhf.orchestration.train_side import needs_old_logprobs
    from rlhf.algo.correction_config import RolloutCorrectionConfig
    from rlhf.stages.config import AlgoConfig, UpdateConfig

    algo = AlgoConfig(rollout_correction=RolloutCorrectionConfig(enable=False))
    assert not needs_old_logprobs(algo, UpdateConfig(), stale=False)
    assert needs_old_logprobs(algo, UpdateConfig(), stale=True)
    assert not needs_old_logprobs(algo, UpdateConfig(recompute_old_logprobs=False), stale=True)
    assert needs_old_logprobs(algo, UpdateConfig(epochs=2), stale=False)


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
    rewards = Path(root) / "rewards.py"
    rewards.write_text("def odd_only(data_source, solution, ground_truth, extra_info):\n"
                       "    return float(len(solution) % 2) if int(ground_truth) % 2 else 0.0\n")
    sampling = ["mesh.placement=split", "mesh.actor={ranks: [0, 2]}", "mesh.rollout={ranks: [2, 4]}",
                "trainer.val_before_train=false", "trainer.val_every=0", "reward.by_source={}",
                f"reward.function={rewards}:odd_only", "algo.filter_groups.enable=true",
                "algo.filter_groups.max_num_gen_batches=3", "trainer.total_steps=1", "run.name=ds"]
    ds_sync = run_trainer(paths, f"{root}/ds_sync", sampling)
    ds_async = run_trainer(paths, f"{root}/ds_async", sampling + ["trainer.async_mode=one_step_off"])
    return ppo, full, resumed, ds_sync, ds_async


@pytest.mark.slow
def test_async_ppo_and_grpo_resume_on_4_ranks(tiny, tmp_path):
    """2 training ranks (actor tp2 + critic + ref, or actor dp2) beside 2 rollout ranks (dp2, or tp2); dynamic
    sampling at rollout dp2."""
    results = run_distributed(_four_rank_runs, 4, tiny, str(tmp_path), timeout_s=900)
    assert results[3] == results[0], "every rank sees the same reduced metrics"
    ppo, full, resumed, ds_sync, ds_async = results[0]
    assert [row["rollout/staleness_max"] for row in ppo] == [0.0, 1.0, 1.0]
    for key in ("critic/vf_loss", "critic/vf_explained_var", "actor/reward_kl_penalty", "timing_s/update_critic",
                "timing_s/gen", "actor/pg_loss"):
        assert all(key in row for row in ppo), key
    assert [row["step"] for row in resumed] == [3, 4]
    assert [_comparable(r) for r in full[2:]] == [_comparable(r) for r in resumed]
    # Dynamic sampling with 2 rollout replicas: the rounds gathered over the rollout mesh, each replica's share of
    # the filled batch exchanged; batch 1 (sampled by v0) trains exactly as in the synchronous loop.
    trained = [{k: v for k, v in _comparable(run[0]).items() if not k.startswith("val/")}
               for run in (ds_async, ds_sync)]
    assert trained[0] == trained[1] and trained[0]["dynamic_sampling/gen_rounds"] > 1


def test_an_in_flight_batch_round_trips_bitwise_and_a_foreign_one_is_refused():
    import dataclasses

    import torch

    from rlhf.errors import CheckpointError
    from rlhf.checkpoint.state_file import decode_state, encode_state
    from rlhf.stages.batch import RolloutBatch, rollout_from_state, rollout_state

    mask_bt = torch.tensor([[True, True, False], [True, False, False]])
    batch = rollout_batch(tokens_bs=torch.randint(0, 50, (2, 7)), prompt_lengths_b=torch.tensor([4, 4]),
                          response_mask_bt=mask_bt, group_index_b=torch.tensor([0, 0]),
                          rollout_logprobs_bt=-torch.rand(2, 3) * mask_bt, policy_version_bt=mask_bt.int() * 7,
                          scores_b=torch.tensor([1.0, 0.0]), pad_token_id=3,
                          reward_components_bk=torch.tensor([[1.0, 0.5, 0.0], [0.0, 0.25, 1.0]]),
                          routed_experts_bslk=torch.randint(-1, 4, (2, 7, 2, 2), dtype=torch.int16))
    back = rollout_from_state(decode_state(encode_state(rollout_state(batch)), "in-flight batch"))
    for field in dataclasses.fields(RolloutBatch):
        mine, theirs = getattr(batch, field.name), getattr(back, field.name)
        if isinstance(mine, torch.Tensor):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), field.name
        else:
            assert mine == theirs, field.name
    foreign = rollout_state(batch) | {"routing_bt": None}
    with pytest.raises(CheckpointError, match=r"^the checkpoint's in-flight batch has fields \['routing_bt'\] this "
                                              r"version does not expect"):
        rollout_from_state(foreign)
    with pytest.raises(CheckpointError, match=r"^the checkpoint's in-flight batch has scores_b of dtype "
                                              r"torch\.float64, this version expects torch\.float32"):
        rollout_from_state(rollout_state(batch) | {"scores_b": batch.scores_b.double()})


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

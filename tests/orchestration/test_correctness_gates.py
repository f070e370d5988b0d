"""Correctness gates on real gloo ranks, and the DAPO recipe end to end with exact resume.

Shared engine (the native engine on the actor's own weights): rollout = train, so at step 1 the PPO KL and the
rollout/training logprob difference are exactly 0, the reference (the initial actor) gives exactly the actor's
old logprobs, and rollout-correction weights are exactly 1. Every sync leaves the engine with the actor's weights.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_val=4)


def _engine_matches_actor(trainer) -> int:
    """Slices verified bit for bit after a sync (collective); the shared engine holds the actor's own tensors."""
    from rlhf.stages.sync import SharedWeights

    weight_sync = trainer.boundary.weight_sync
    if isinstance(weight_sync, SharedWeights):
        engine = {p.data_ptr() for p in trainer.rollout_side.engine.model.parameters()}
        assert engine == {p.data_ptr() for p in trainer.train_side.actor.model.parameters()}
        return len(engine)
    return weight_sync.check()


def _watched_run(paths, root, overrides, config=None):
    """A trainer run that records the batch of every actor update and checks the engine after every sync."""
    import torch.distributed as dist

    from rlhf.orchestration.schema import RlhfConfig
    from rlhf.config.loader import load_config
    from rlhf.run_dir import close_run, setup_run
    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight

    cfg = trainer_config(paths, root, overrides)
    if config is not None:  # a recipe file under the tiny setup's paths and sizes
        fixture = [f"model.path={paths['model']}", f"data.train_files=[{paths['train']}]",
                   f"data.val_files=[{paths['val']}]", f"run.output_dir={root}", "trainer.tensorboard=false",
                   "data.prompts_per_step=4", "actor.micro_batch_size=4",
                   "rollout.native.max_batch_size=16", "rollout.native.max_seq_len=32", "dist.timeout_s=60"]
        cfg = load_config(RlhfConfig, config, fixture + overrides)
    preflight(cfg, dist.get_world_size())
    run_dir = setup_run(cfg.run, cfg)
    try:
        trainer = Trainer(cfg, run_dir)
        batches, checks, weight_sync = [], [], trainer.boundary.weight_sync
        trainer.scored_hooks.append(lambda batch, step: batches.append(batch))
        sync = weight_sync.sync
        weight_sync.sync = lambda: (sync(), checks.append(_engine_matches_actor(trainer)))[0]
        history = trainer.fit()
        return {"history": history, "batches": batches, "checks": checks,
                "consumed": trainer.loader.sampler.consumed_batches}
    finally:
        close_run()


def _gate_runs(paths, root):
    reward = Path(root) / "rewards.py"
    reward.write_text("def length(data_source, solution, ground_truth, extra_info):\n"  # dense: the update moves
                      "    return float(len(solution) % 2)\n"
                      "def odd_only(data_source, solution, ground_truth, extra_info):\n"  # even answers: all 0
                      "    return float(len(solution) % 2) if int(ground_truth) % 2 else 0.0\n")
    dense = ["reward.by_source={}", f"reward.function={reward}:length", "trainer.val_before_train=false",
             "actor.optim.lr=0.05"]
    shared = _watched_run(paths, f"{root}/shared", dense + [
        "algo.kl.coef=0.01", "algo.rollout_correction.enable=true", "run.name=s", "trainer.total_steps=2"])
    resharded = _watched_run(paths, f"{root}/reshard", dense + [
        "mesh.actor.tp=2", "mesh.rollout.tp=1", "run.name=x", "trainer.total_steps=2",
        "actor.recompute_old_logprobs=false"])  # decoupled correction still runs the old-logprob forward
    bypass = _watched_run(paths, f"{root}/bypass", dense + [
        "mesh.actor.tp=2", "mesh.rollout.tp=1", "run.name=b", "trainer.total_steps=1",
        "algo.rollout_correction.bypass_mode=true", "algo.rollout_correction.rollout_is=null"])
    recipe = str(REPO / "configs/dapo_cpu.yaml")
    dapo = _watched_run(paths, f"{root}/dapo", dense + ["run.name=d", "trainer.total_steps=2",
                                                        "algo.overlong_filter=true"], config=recipe)
    # Dynamic sampling under resume: a reward that zeroes every group of an even answer, no length shaping.
    sparse = dense + [f"reward.function={reward}:odd_only", "algo.overlong_buffer.len=0", "checkpoint.every=2",
                      "trainer.val_every=0", "run.name=ds"]
    full = _watched_run(paths, f"{root}/ds", sparse + ["trainer.total_steps=4"], config=recipe)
    _watched_run(paths, f"{root}/ds_split", sparse + ["trainer.total_steps=2"], config=recipe)
    resumed = _watched_run(paths, f"{root}/ds_split", sparse + ["trainer.total_steps=4"], config=recipe)
    return shared, resharded, bypass, dapo, full, resumed


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/throughput", "memory/"))}


def test_correctness_gates_and_the_dapo_recipe(tiny, tmp_path):
    world = run_distributed(_gate_runs, 2, tiny, str(tmp_path), timeout_s=600)
    shared, resharded, bypass, dapo, full, resumed = world[0]
    # Shared engine, every step: the PPO KL is exactly 0 (old logprobs = the update's first forward) and the
    # reference (the initial actor) gives bit for bit the actor's old logprobs at step 1. The native engine is
    # its own implementation of the forward (KV-cached attention, fused residual GEMMs), so its logprobs agree
    # with training to an ulp (2.4e-7 measured at |logp| < 4), not bitwise: weights are 1 to that precision.
    for row in shared["history"]:
        assert row["actor/ppo_kl"] == 0.0 and row["rollout/logprob_diff_max"] < 1e-6, row
        assert abs(row["rollout_corr/is_weight_max"] - 1) < 1e-6 and abs(row["rollout_corr/is_weight_min"] - 1) < 1e-6
        assert abs(row["rollout_corr/kl"]) < 1e-7 and row["rollout_corr/rs_masked_fraction"] == 0.0
    first = shared["batches"][0]
    assert torch.equal(first.ref_logprobs_bt, first.old_logprobs_bt), "ref is the initial actor at step 1"
    assert shared["history"][0]["actor/kl_loss"] == 0.0
    assert not torch.equal(shared["batches"][1].ref_logprobs_bt, shared["batches"][1].old_logprobs_bt)
    for batch in shared["batches"]:
        torch.testing.assert_close(batch.is_weights_bt, batch.response_mask_bt.float(), rtol=0, atol=1e-6)
    assert len(shared["checks"]) == 2 and min(shared["checks"]) > 0  # one per step: the engine's are the actor's
    # Resharded engine (actor tp2 -> rollout tp1 x dp2): checksummed equal after every sync (initial push
    # included); `auto` turns the correction on, its weights within the reduction-order noise of 1.
    assert len(resharded["checks"]) == 3 and min(resharded["checks"]) > 0
    for row in resharded["history"]:
        assert row["rollout/logprob_diff_max"] < 1e-4 and row["actor/grad_norm"] > 0
        assert abs(row["rollout_corr/is_weight_max"] - 1) < 1e-4 and row["rollout_corr/is_truncated_fraction"] == 0
    # Bypass: the rollout log-probs are the PPO anchor, no old-logprob forward.
    assert "timing_s/old_log_prob" not in bypass["history"][0] and "timing_s/old_log_prob" in resharded["history"][0]
    assert torch.equal(bypass["batches"][0].old_logprobs_bt, bypass["batches"][0].rollout_logprobs_bt)
    assert bypass["batches"][0].is_weights_bt is None and "rollout/logprob_diff_max" not in bypass["history"][0]
    # The DAPO recipe runs end to end: length shaping moves rewards below 0, dynamic sampling reports, and
    # overlong filtering takes exactly the truncated responses out of the actor's loss.
    for row, batch in zip(dapo["history"], dapo["batches"]):
        assert row["critic/overlong_penalty/mean"] < 0 and row["critic/score/min"] < 0
        assert row["dynamic_sampling/kept_groups"] + row["dynamic_sampling/filled_groups"] == 4
        assert "rollout_corr/kl" not in row, "auto: the shared engine needs no correction"
        truncated = batch.truncated_b  # finish reason `length`: max_new_tokens (5 in the recipe) without EOS
        assert 0 < truncated.sum() < batch.size and bool((batch.response_lengths_b[truncated] == 5).all())
        assert torch.equal(batch.loss_mask_bt, batch.response_mask_bt & ~truncated[:, None])
        assert row["response_length/overlong_filtered_fraction"] == truncated.float().mean().item()
    # Dynamic sampling: every step trains on exactly data.prompts_per_step groups; each round consumed one
    # loader batch, on every rank alike; the resumed run equals the uninterrupted one.
    assert [batch.size for batch in full["batches"]] == [4 * 8] * 4  # the recipe samples n=8 per prompt
    for row in full["history"]:
        assert row["dynamic_sampling/kept_groups"] + row["dynamic_sampling/filled_groups"] == 4
    rounds = [row["dynamic_sampling/gen_rounds"] for row in full["history"]]
    assert max(rounds) > 1 and min(rounds) >= 1 and sum(row["dynamic_sampling/dropped_groups"]
                                                        for row in full["history"]) > 0
    assert [rank[4]["consumed"] for rank in world] == [sum(rounds)] * 2
    assert [_comparable(r) for r in full["history"][2:]] == [_comparable(r) for r in resumed["history"]]
    assert resumed["consumed"] == sum(rounds)

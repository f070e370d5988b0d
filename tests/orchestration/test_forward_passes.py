"""Forwards that compute nothing new are skipped, and skipping them changes nothing (2 gloo ranks, GRPO).

Strictly on-policy (one epoch, one mini-batch: every micro-batch of the one optimizer step sees the pre-update
weights), the actor's old-logprob forward equals the update's own forward, detached; with `auto` the step skips
it. With the KL coefficient 0 no reference model is built, so no reference forward runs.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import length_reward, make_tiny_setup, trainer_config  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_val=4)


def _counted_run(paths, root, overrides):
    """A trainer run that counts the actor's forward-only (old-logprob) passes and the reference's."""
    import torch.distributed as dist

    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight
    from rlhf.run_dir import close_run, setup_run

    cfg = trainer_config(paths, root, overrides)
    preflight(cfg, dist.get_world_size())
    run_dir = setup_run(cfg.run, cfg)
    try:
        trainer = Trainer(cfg, run_dir)
        side, counts = trainer.train_side, {"old": 0, "ref": 0}

        def counted(name, fn):
            def call(*args, **kwargs):
                counts[name] += 1
                return fn(*args, **kwargs)
            return call

        side.actor.logprobs = counted("old", side.actor.logprobs)
        if side.ref is not None:
            side.ref.logprobs = counted("ref", side.ref.logprobs)
        batches = []
        trainer.scored_hooks.append(lambda batch, step: batches.append(batch.old_logprobs_bt is None))
        return {"history": trainer.fit(), "counts": counts, "skipped": batches, "has_ref": side.ref is not None}
    finally:
        close_run()


def _runs(paths, root):
    common = [length_reward(Path(root)), "reward.by_source={}", "trainer.val_before_train=false",
              "trainer.val_every=0", "actor.optim.lr=0.05", "actor.micro_batch_size=2", "trainer.total_steps=2"]
    return {name: _counted_run(paths, f"{root}/{name}", common + [f"run.name={name}", *extra])
            for name, extra in (("recompute", ["actor.recompute_old_logprobs=true"]),
                                ("auto", ["actor.recompute_old_logprobs=auto"]),
                                ("kl_loss", ["actor.recompute_old_logprobs=auto", "algo.kl.coef=0.01"]),
                                ("kl_reward", ["actor.recompute_old_logprobs=auto", "algo.kl.coef=0.01",
                                               "algo.kl.in_reward=true"]))}


def test_on_policy_update_skips_the_old_logprob_forward_and_matches_it(tiny, tmp_path):
    runs = run_distributed(_runs, 2, tiny, str(tmp_path), timeout_s=600)[0]
    recompute, auto = runs["recompute"], runs["auto"]
    # Pass counts per run (2 steps): the recompute path runs one old-logprob forward per step, auto none;
    # KL coef 0 builds no reference; KL as a loss needs the reference but not the old logprobs; KL in the
    # reward reads both before the update.
    assert recompute["counts"] == {"old": 2, "ref": 0} and not recompute["has_ref"]
    assert auto["counts"] == {"old": 0, "ref": 0} and auto["skipped"] == [True, True]
    assert runs["kl_loss"]["counts"] == {"old": 0, "ref": 2}
    assert runs["kl_reward"]["counts"] == {"old": 2, "ref": 2} and runs["kl_reward"]["skipped"] == [False, False]
    for old, new in zip(recompute["history"], auto["history"], strict=True):
        assert "timing_s/old_log_prob" in old and "timing_s/old_log_prob" not in new
        keys = [k for k in old if k.startswith(("actor/", "critic/", "response_length/"))]
        assert keys and {"actor/pg_loss", "actor/grad_norm", "actor/entropy"} <= set(keys)
        for key in keys:
            assert new[key] == pytest.approx(old[key], abs=1e-6), key
        assert new["actor/ppo_kl"] == 0.0 and abs(old["actor/ppo_kl"]) < 1e-6

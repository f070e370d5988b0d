"""Async RL with real vLLM as the rollout engine (`make test-vllm`) on 2 gloo ranks: the actor on rank 0, vLLM
on rank 1 alone (its world is the rollout mesh, `vllm_engine.rollout_world`), with partial rollouts: the rows
still running after 2 tokens continue after the weight push with the new weights; a resume with a started batch
equals the uninterrupted run. With the weights all but fixed (lr 1e-9), every token's rollout logprob, the
continued ones included, equals the training forward's on the merged sequence (a misplaced handoff would not).
Slow: a tp2 vLLM replica on ranks 2-3 beside actor dp2 on ranks 0-1."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="needs vLLM: make install-vllm")]

ASYNC = ["rollout.engine=vllm", "rollout.vllm.enforce_eager=true", "rollout.vllm.kv_cache_gb=0.25",
         "model.dtype=float32", "sampling.temperature=0.8", "mesh.placement=split", "mesh.actor={ranks: [0, 1]}",
         "mesh.rollout={ranks: [1, 2]}", "trainer.async_mode=one_step_off", "trainer.max_staleness=2",
         "trainer.partial_rollout_tokens=2", "trainer.val_before_train=false", "checkpoint.every=2", "run.name=p"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # vLLM's CPU attention needs head_dim >= 32
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_val=4, hidden_size=64, num_heads=2,
                           num_kv_heads=2, intermediate_size=128)


def _runs(paths, root):
    reward = Path(root) / "length_reward.py"
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    common = ASYNC + ["reward.by_source={}", f"reward.function={reward}:score"]
    fixed = run_trainer(paths, f"{root}/fixed", common + ["actor.optim.lr=1e-9", "trainer.total_steps=3"])
    moving = common + ["actor.optim.lr=0.05"]
    full = run_trainer(paths, f"{root}/full", moving + ["trainer.total_steps=4"])
    run_trainer(paths, f"{root}/split", moving + ["trainer.total_steps=2"])
    resumed = run_trainer(paths, f"{root}/split", moving + ["trainer.total_steps=4"])
    return fixed, full, resumed


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/throughput", "memory/"))}


def test_async_partial_rollouts_on_vllm_alone_on_its_rank(tiny, tmp_path):
    ranks = run_distributed(_runs, 2, tiny, str(tmp_path), env={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout_s=1200)
    assert ranks[1] == ranks[0], "every rank sees the same reduced metrics"
    fixed, full, resumed = ranks[0]
    for row in fixed:
        assert row["rollout/logprob_diff_max"] <= 1e-5, row["rollout/logprob_diff_max"]
    assert [row["rollout/staleness_max"] for row in full] == [0.0, 1.0, 2.0, 2.0]
    assert all(1.0 < row["rollout/staleness_mean"] < 2.0 for row in full[2:])
    assert all(row["rollout/logprob_diff_max"] > 1e-3 for row in full[1:]), "stale tokens: the weights moved"
    assert [row["step"] for row in resumed] == [3, 4]
    assert [_comparable(r) for r in full[2:]] == [_comparable(r) for r in resumed]


def _tp2_run(paths, root):
    return run_trainer(paths, f"{root}/tp2", ASYNC + [
        "mesh.actor={ranks: [0, 2]}", "mesh.rollout={tp: 2, ranks: [2, 4]}", "actor.optim.lr=1e-9",
        "trainer.total_steps=3"])


@pytest.mark.slow
def test_async_on_a_vllm_tp2_mesh_beside_two_training_ranks(tiny, tmp_path):
    """4 ranks: actor dp2 on ranks 0-1, one vLLM replica at tp2 on ranks 2-3 (its TP collectives in its world)."""
    ranks = run_distributed(_tp2_run, 4, tiny, str(tmp_path), env={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout_s=1200)
    assert all(rank == ranks[0] for rank in ranks), "every rank sees the same reduced metrics"
    assert [row["rollout/staleness_max"] for row in ranks[0]] == [0.0, 1.0, 2.0]
    for row in ranks[0]:
        assert row["rollout/logprob_diff_max"] <= 1e-5, row["rollout/logprob_diff_max"]

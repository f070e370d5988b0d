"""GRPO with real vLLM as the rollout engine on 2 gloo ranks (`make test-vllm`), one launched world: rollout
tp=2, then tp=1 x dp=2, a resume with engine=vllm equal to the uninterrupted run, and a Qwen3-MoE policy
trained at tp=2 and rolled out by vLLM at tp=2 (vLLM's fused experts, split over tp). In fp32 the rollout
logprobs (vLLM's, at the sampling temperature) equal the training forward's within 1e-5 at every step, which
holds only if every sync left the engine with the actor's weights."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="needs vLLM: make install-vllm")]

VLLM = ["rollout.engine=vllm", "rollout.vllm.enforce_eager=true", "rollout.vllm.kv_cache_gb=0.25",
        "model.dtype=float32", "sampling.temperature=0.8", "actor.optim.lr=0.05", "trainer.total_steps=3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # vLLM's CPU attention needs head_dim >= 32
    dims = dict(num_val=4, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128)
    moe = make_tiny_setup(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", num_experts=4,
                          num_experts_per_token=2, expert_intermediate_size=128, **dims)
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), **dims), moe


def _runs(paths, moe_paths, root):
    reward = Path(root) / "length_reward.py"  # a reward that varies within groups, so every step updates
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    common = VLLM + ["reward.by_source={}", f"reward.function={reward}:score"]
    tp2 = run_trainer(paths, f"{root}/tp2", common + ["mesh.rollout.tp=2", "run.name=tp2"])
    resume = common + ["checkpoint.every=2", "run.name=r", "trainer.val_before_train=false"]
    full = run_trainer(paths, f"{root}/full", resume)
    run_trainer(paths, f"{root}/split", resume + ["trainer.total_steps=2"])
    resumed = run_trainer(paths, f"{root}/split", resume)
    # a Qwen3-MoE policy trained at tp2, rolled out by vLLM at tp2 (experts split over tp on both sides)
    moe = run_trainer(moe_paths, f"{root}/moe", common + ["mesh.actor.tp=2", "mesh.rollout.tp=2", "run.name=moe"])
    return tp2, full, resumed, moe


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/throughput", "memory/"))}


def test_grpo_with_vllm_at_tp2_and_dp2_and_exact_resume(tiny, tmp_path):
    results = run_distributed(_runs, 2, *tiny, str(tmp_path), env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                              timeout_s=1500)
    tp2, full, resumed, moe = results[0]
    assert results[1] == results[0], "every rank sees the same reduced metrics"
    assert [row["step"] for row in tp2] == [0, 1, 2, 3] and [row["step"] for row in full] == [1, 2, 3]
    for row in tp2[1:] + full + moe[1:]:
        assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0, row
        assert row["rollout/logprob_diff_max"] <= 1e-5, row["rollout/logprob_diff_max"]
    assert "val/score/mean@1" in tp2[0] and "val/score/mean@1" in tp2[-1]
    assert [row["step"] for row in resumed] == [3] and [row["step"] for row in moe] == [0, 1, 2, 3]
    assert _comparable(full[2]) == _comparable(resumed[0])

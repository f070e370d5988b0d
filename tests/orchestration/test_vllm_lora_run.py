"""GRPO with a LoRA actor rolled out by real vLLM on 2 gloo ranks (`make test-vllm`), one launched world:
`lora.sync=adapter` (vLLM's own LoRA support: the base pushed once, then a PEFT folder per policy version) against
`lora.sync=merged` (W + (alpha / r) B A pushed every step), and an exact resume of the adapter run. In fp32 the
rollout logprobs (vLLM's) equal the training forward's within 1e-5 at every step in both modes, which holds only
if vLLM generated with the trainer's current base + adapters."""

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

SETTINGS = ["rollout.engine=vllm", "rollout.vllm.enforce_eager=true", "rollout.vllm.kv_cache_gb=0.25",
            "model.dtype=float32", "sampling.temperature=0.8", "lora.enabled=true", "lora.rank=4", "lora.alpha=8",
            "actor.optim.lr=0.05", "algo.kl.coef=0.01", "trainer.val_before_train=false", "data.val_files=[]",
            "trainer.total_steps=3", "run.name=r"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # vLLM's CPU attention needs head_dim >= 32
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_heads=2, num_kv_heads=2,
                           intermediate_size=128)


def _runs(paths, root):
    reward = Path(root) / "length_reward.py"  # a reward that varies within groups, so every step updates
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    common = SETTINGS + ["reward.by_source={}", f"reward.function={reward}:score", "checkpoint.every=2"]
    folders = []

    def adapter_folders(batch, step):  # what the run folder holds while training: the loaded versions only
        folders.append(sorted(p.name for p in (Path(root) / "adapter/r/lora_sync").iterdir()))

    adapter = run_trainer(paths, f"{root}/adapter", common + ["lora.sync=adapter"], on_scored=adapter_folders)
    merged = run_trainer(paths, f"{root}/merged", common + ["lora.sync=merged"])
    run_trainer(paths, f"{root}/split", common + ["lora.sync=adapter", "trainer.total_steps=2"])
    resumed = run_trainer(paths, f"{root}/split", common + ["lora.sync=adapter"])
    left = (Path(root) / "adapter/r/lora_sync").exists()
    return adapter, merged, resumed, folders, left


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/throughput", "memory/", "sync/"))}


def test_grpo_with_lora_through_vllm_adapters_equals_merged_and_resumes_exactly(tiny, tmp_path):
    results = run_distributed(_runs, 2, tiny, str(tmp_path), env={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout_s=1500)
    adapter, merged, resumed, folders, left = results[0]
    assert results[1][:3] == results[0][:3], "every rank sees the same reduced metrics"
    assert [row["step"] for row in adapter] == [1, 2, 3] and [row["step"] for row in resumed] == [3]
    for row in adapter + merged + resumed:
        assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0, row
        assert row["rollout/logprob_diff_max"] <= 1e-5, row["rollout/logprob_diff_max"]
    assert adapter[-1]["actor/kl_loss"] > 0.0, "the adapters moved away from the base"
    # the adapter run's updates are the merged run's (vLLM computes W x + B A x instead of (W + B A) x: fp32
    # rounding apart, the same samples and the same losses)
    for a, m in zip(adapter, merged):
        assert a["critic/score/mean"] == m["critic/score/mean"]
        assert a["actor/pg_loss"] == pytest.approx(m["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert _comparable(adapter[2]) == _comparable(resumed[0])
    # the default trainer.max_staleness=1 keeps 2 slots: one adapter folder per sync (the first sync's policy
    # version is reset to the checkpoint's, so the folders count pushes); all gone once the engine closed
    assert folders == [["v1"], ["v1", "v2"], ["v2", "v3"]] and not left

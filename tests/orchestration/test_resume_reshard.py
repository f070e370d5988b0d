"""Resume when the rollout engine holds its own (resharded) copy of the policy: the engine must generate with
the resumed actor's weights, so the resumed run equals the uninterrupted one."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

RESHARD = ["mesh.actor.tp=2", "mesh.rollout.tp=1", "actor.optim.lr=0.05", "checkpoint.every=2", "run.name=r",
           "trainer.val_before_train=false", "rollout.sleep=kv_cache_and_weights", "actor.optim.offload=true"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_val=4)


def _runs(paths, root, dtype):
    reward = Path(root) / "length_reward.py"
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    common = RESHARD + ["reward.by_source={}", f"reward.function={reward}:score", f"model.dtype={dtype}"]
    full = run_trainer(paths, f"{root}/full", common + ["trainer.total_steps=4"])
    run_trainer(paths, f"{root}/split", common + ["trainer.total_steps=2"])
    resumed = run_trainer(paths, f"{root}/split", common + ["trainer.total_steps=4"])
    return full, resumed


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/throughput", "memory/"))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: master weights and resharding round-trip too
def test_resumed_run_generates_with_the_resumed_weights(tiny, tmp_path, dtype):
    full, resumed = run_distributed(_runs, 2, tiny, str(tmp_path), dtype, timeout_s=400)[0]
    assert [row["step"] for row in resumed] == [3, 4]
    assert full[3]["actor/grad_norm"] > 0
    assert [_comparable(r) for r in full[2:]] == [_comparable(r) for r in resumed]

"""An MoE actor at ep=2 (each rank holds half the experts) resumes at its own layout, on 2 ranks: killed
during step 3 (its checkpoint never published), `resume: auto` takes step 2 and step 3 equals the
uninterrupted run's (the replica check compares the experts over expert-DP, the dense weights over DP)."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_moe_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    return make_moe_setup(tmp_path_factory.mktemp("moe"))


def _kill_and_resume(paths: dict, root: str) -> dict:
    import torch.distributed as dist

    reward = Path(root) / "length_reward.py"  # a dense signal, so every update moves the weights
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    common = ["run.name=m", "mesh.actor.ep=2", "checkpoint.every=1", "checkpoint.keep_last=3",
              "trainer.total_steps=3", "trainer.val_before_train=false", "reward.by_source={}",
              f"reward.function={reward}:score"]
    uninterrupted = run_trainer(paths, root, common)
    ckpt = Path(root) / "m" / "checkpoints"
    if dist.get_rank() == 0:  # killed during step 3: its checkpoint was never published
        shutil.rmtree(ckpt / "step_3")
        (ckpt / "latest").write_text("step_2")
    dist.barrier()
    resumed = run_trainer(paths, root, common)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "log": (Path(root) / "m" / "rank0.log").read_text()}


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", "memory/"))}


def test_moe_at_ep2_killed_and_resumed_equals_the_uninterrupted_run(moe_setup, tmp_path):
    out = run_distributed(_kill_and_resume, 2, moe_setup, str(tmp_path), timeout_s=900)[0]
    assert f"resumed from {tmp_path}/m/checkpoints/step_2 (step 2)" in out["log"]
    assert [row["step"] for row in out["resumed"]] == [3]
    step3 = out["uninterrupted"][-1]
    assert step3["step"] == 3 and step3["actor/grad_norm"] > 0
    assert _comparable(out["resumed"][0]) == _comparable(step3)

"""Async checkpoint save on 2 ranks, in one launched world: the files a writer thread writes while training goes on
equal a sync save's; a writer that fails mid-write publishes nothing (one line on every rank, the partial folder
has no manifest, `latest` still names the previous step) and `resume: auto` goes on from that previous step
exactly as the uninterrupted run did."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

COMMON = ["checkpoint.every=1", "checkpoint.keep_last=4", "trainer.total_steps=4", "trainer.val_before_train=false",
          "actor.optim.lr=0.05", "reward.by_source={}", "actor.optim.use_distributed_optimizer=true"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_val=4)


def _fail_mid_write(step_name: str, rank: int):
    """A `write_tensor_file` that, on `rank` while writing `step_name`, writes half a file and then fails."""
    import torch.distributed as dist

    from rlhf.checkpoint import write as checkpoint_write

    real = checkpoint_write.write_tensor_file

    def write(path, tensors):
        if path.parent.name == f"{step_name}.tmp" and dist.get_rank() == rank:
            real(path, tensors)
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            raise OSError(28, "No space left on device (injected)")
        return real(path, tensors)

    return write


def _tensors(step: Path) -> dict:
    from safetensors.torch import load_file

    return {f"{file.name.split('_r')[0]}/{name}": tensor for file in sorted(step.glob("actor_*.safetensors"))
            for name, tensor in load_file(file).items()}


def _runs(paths, root):
    from rlhf.checkpoint import write as checkpoint_write
    from rlhf.errors import CheckpointError

    reward = Path(root) / "length_reward.py"
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    common = COMMON + [f"reward.function={reward}:score"]
    out = {"sync": run_trainer(paths, root, common + ["run.name=sync"]),
           "async": run_trainer(paths, root, common + ["run.name=async", "checkpoint.async_save=true"])}
    sync_ckpt, async_ckpt = (Path(root) / name / "checkpoints" for name in ("sync", "async"))
    out["same_files"] = all(
        (lambda a, b: a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a))(_tensors(sync_ckpt / step),
                                                                                  _tensors(async_ckpt / step))
        for step in ("step_1", "step_2", "step_3", "step_4"))
    failing = common + ["run.name=failed", "checkpoint.async_save=true"]
    real = checkpoint_write.write_tensor_file
    checkpoint_write.write_tensor_file = _fail_mid_write("step_3", rank=1)
    try:
        run_trainer(paths, root, failing)
        out["error"] = None
    except CheckpointError as error:
        out["error"] = str(error)
    finally:
        checkpoint_write.write_tensor_file = real
    ckpt = Path(root) / "failed" / "checkpoints"
    out["after_failure"] = {"latest": (ckpt / "latest").read_text(), "folders": sorted(p.name for p in ckpt.iterdir()),
                            "partial_has_manifest": (ckpt / "step_3.tmp" / "manifest.json").exists()}
    out["resumed"] = run_trainer(paths, root, failing)
    out["log"] = (Path(root) / "failed" / "rank0.log").read_text()
    return out


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", "memory/"))}


def test_async_save_equals_sync_and_a_failed_write_keeps_the_previous_checkpoint(tiny, tmp_path):
    results = run_distributed(_runs, 2, tiny, str(tmp_path), timeout_s=900)
    out = results[0]
    assert [_comparable(r) for r in out["async"]] == [_comparable(r) for r in out["sync"]]
    assert out["same_files"]
    ckpt = tmp_path / "failed" / "checkpoints"
    for result in results:  # the same one line on every rank, raised at the next step boundary
        assert result["error"] == (f"checkpoint {ckpt}/step_3 was not published: rank 1 failed to write it "
                                   "(OSError: [Errno 28] No space left on device (injected)); the previous "
                                   "checkpoint stays latest")
    assert out["after_failure"] == {"latest": "step_2", "folders": ["latest", "step_1", "step_2", "step_3.tmp"],
                                    "partial_has_manifest": False}
    assert f"resumed from {ckpt}/step_2 (step 2)" in out["log"]
    assert [row["step"] for row in out["resumed"]] == [3, 4]
    assert [_comparable(r) for r in out["resumed"]] == [_comparable(r) for r in out["sync"][2:]]

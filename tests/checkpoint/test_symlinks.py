"""Symlink attacks inside a temporary folder: rlhf never reads, writes or deletes through a symlink that leaves
the run folder. `checkpoints/latest` is a name, not a path; a symlinked `step_<N>` is skipped (auto) or refused
(explicit) and never pruned; a symlinked `checkpoints/`, `hf/` (save_hf_every) or `rollouts/` (dump_rollouts)
is a one-line error; the other folder's files are untouched."""

import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhf.checkpoint import CheckpointManager, find_latest
from rlhf.errors import CheckpointError, ConfigError

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
from fixtures import trainer_config  # noqa: E402


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def other(tmp_path) -> Path:
    """Another run's checkpoints, with a complete step_7 and step_9."""
    root = tmp_path / "other" / "checkpoints"
    manager = CheckpointManager(root, keep_last=5)
    for step in (7, 9):
        manager.save(step, {"who": "other", "step": step}, tensors={"actor": {"model": {"w": torch.ones(2)}}})
    return root


def _run(tmp_path: Path) -> CheckpointManager:
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=2)
    for step in (1, 2):
        manager.save(step, {"who": "run", "step": step})
    return manager


def _warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


@pytest.mark.parametrize("pointer", ["../../other/checkpoints/step_7", "absolute"])
def test_latest_is_a_name_never_a_path(pointer, tmp_path, other, caplog):
    manager = _run(tmp_path)
    text = str(other / "step_7") if pointer == "absolute" else pointer
    (manager.root / "latest").write_text(text)
    with caplog.at_level(logging.WARNING, logger="rlhf.checkpoint"):
        assert find_latest(manager.root) == manager.root / "step_2"  # export's pick: this run's newest
    assert _warnings(caplog) == [f"checkpoint: ignoring {manager.root}/latest: it holds {text!r}, not a step_<N> name"]
    (manager.root / "latest").unlink()
    os.symlink(other / "step_7" / "manifest.json", manager.root / "latest")  # a symlinked pointer is not read
    assert find_latest(manager.root) == manager.root / "step_2"


def test_a_symlinked_step_folder_is_skipped_refused_and_never_pruned(tmp_path, other, caplog):
    manager = _run(tmp_path)
    before = _snapshot(other)
    os.symlink(other / "step_9", manager.root / "step_9")
    os.symlink(other / "step_7", manager.root / "step_0")
    with caplog.at_level(logging.WARNING, logger="rlhf.checkpoint"):
        path, state, _ = manager.load_for_resume("auto")
        assert find_latest(manager.root) == manager.root / "step_2"
    assert (path.name, state["who"]) == ("step_2", "run")
    assert (f"checkpoint: skipping step_9: a symlink (to {other}/step_9); checkpoints are never read through one"
            in _warnings(caplog))
    with pytest.raises(CheckpointError, match=rf"^checkpoint\.resume='{manager.root}/step_9' is a symlink \(to "
                                              rf"{other}/step_9\); checkpoints are never read through one: name "
                                              r"the real folder$"):
        manager.load_for_resume(str(manager.root / "step_9"))
    for step in (3, 4, 9):  # pruning keeps 2; step 9 is saved over the link, not into the other run
        manager.save(step, {"who": "run", "step": step})
    assert sorted(p.name for p in manager.root.iterdir()) == ["latest", "step_0", "step_4", "step_9"]
    assert not (manager.root / "step_9").is_symlink() and (manager.root / "step_0").is_symlink()
    assert _snapshot(other) == before


def test_a_symlinked_checkpoints_folder_is_refused(tmp_path, other):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(other, run / "checkpoints")
    before = _snapshot(other)
    message = (rf"^{run}/checkpoints is a symlink \(to {other}\); rlhf never reads, writes or prunes checkpoints "
               r"through a symlink out of the run folder: make it a real folder$")
    manager = CheckpointManager(run / "checkpoints", keep_last=1)
    for call in (lambda: manager.save(10, {"who": "run"}), lambda: manager.load_for_resume("auto"),
                 lambda: find_latest(run / "checkpoints")):
        with pytest.raises(CheckpointError, match=message):
            call()
    assert _snapshot(other) == before


def test_symlinked_hf_and_rollouts_folders_are_refused_before_any_write(tmp_path):
    from rlhf.orchestration.checkpointing import RunCheckpoints
    from rlhf.run_dir import RunDir
    from rlhf.orchestration.rollout_dump import RolloutDumper

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "step_000005.parquet").write_bytes(b"someone else's")
    (outside / "step_2").mkdir()
    (outside / "step_2" / "model.safetensors").write_bytes(b"someone else's")
    before = _snapshot(outside)
    run = tmp_path / "runs" / "t"
    run.mkdir(parents=True)
    os.symlink(outside, run / "hf")
    os.symlink(outside, run / "rollouts")
    cfg = trainer_config({"model": "m", "train": "t", "val": "v"}, str(tmp_path / "runs"),
                         ["checkpoint.save_hf_every=1"])
    with pytest.raises(ConfigError, match=rf"^checkpoint\.save_hf_every folder {run}/hf is a symlink to {outside}, "
                                          r"outside the run folder; rlhf never writes or deletes through one: "
                                          r"remove the link or make it a real folder$"):
        RunCheckpoints(cfg, RunDir(run, 0), None, None, None, None, None, None, None)
    with pytest.raises(ConfigError, match=rf"^trainer\.dump_rollouts folder {run}/rollouts is a symlink to {outside}"):
        RolloutDumper(run / "rollouts", every=1, records=[], tokenizer=None, enabled=True)
    os.remove(run / "hf")
    (run / "hf").mkdir()
    os.symlink(run / "hf", run / "hf_link")  # a link that stays inside the run folder is fine
    RunCheckpoints(cfg, RunDir(run, 0), None, None, SimpleNamespace(engine=None), None, None, None, None)
    assert _snapshot(outside) == before

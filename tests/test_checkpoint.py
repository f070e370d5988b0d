"""Checkpoints: atomic publish on 2 ranks, keep-last pruning, interrupted writes never picked, exact reload."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from rlhf.checkpoint import CheckpointManager, find_latest
from rlhf.errors import CheckpointError
from rlhf.testing.distributed import run_distributed


def _save_three(root):
    manager = CheckpointManager(root, keep_last=2)
    rank = dist.get_rank()
    for step in (1, 2, 3):
        manager.save(step, {"w": torch.full((3,), float(step * 10 + rank)), "rng": torch.get_rng_state()},
                     meta={"layout": "dp2"})
    path = manager.resolve("auto")
    state, meta = manager.load(path, expected_meta={"layout": "dp2"})
    try:
        manager.load(path, expected_meta={"layout": "tp2"})
        mismatch = None
    except CheckpointError as err:
        mismatch = str(err)
    return path.name, state["w"].tolist(), meta["step"], mismatch


def test_save_prune_and_reload_on_2_ranks(tmp_path):
    results = run_distributed(_save_three, 2, tmp_path, timeout_s=60)
    assert results[0][:3] == ("step_3", [30.0] * 3, 3) and results[1][:3] == ("step_3", [31.0] * 3, 3)
    assert results[0][3].endswith("has layout='dp2' but this run has 'tp2'; resume with the same setting or "
                                  "export to HF and re-import")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2", "step_3"]
    assert (tmp_path / "latest").read_text() == "step_3"
    assert json.loads((tmp_path / "step_3/meta.json").read_text())["world_size"] == 2


def test_interrupted_writes_are_never_picked(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(3, {"x": 1})
    shutil.copytree(tmp_path / "step_3", tmp_path / "step_4.tmp")  # crash before the rename
    (tmp_path / "step_5").mkdir()  # crash before meta.json (cannot happen by protocol, still refused)
    torch.save({"x": 5}, tmp_path / "step_5" / "rank0.pt")
    shutil.copytree(tmp_path / "step_3", tmp_path / "step_6")
    os.remove(tmp_path / "step_6" / "rank0.pt")  # a rank file lost
    assert find_latest(tmp_path).name == "step_3"
    (tmp_path / "latest").write_text("step_6")  # a stale pointer is not trusted either
    assert find_latest(tmp_path).name == "step_3"
    assert manager.resolve("none") is None
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume='.*step_5' is not a complete checkpoint"):
        manager.resolve(str(tmp_path / "step_5"))
    assert find_latest(tmp_path / "missing") is None

"""Checkpoints: atomic publish on 2 ranks, keep-last pruning, interrupted writes never picked, exact reload;
no pickle is ever loaded, and a corrupt, truncated or empty shard is named on every rank (auto falls back)."""

import json
import logging
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rlhf.checkpoint import MANIFEST, CheckpointManager, CorruptCheckpointError, Replicated, find_latest
from rlhf.checkpoint.verify import file_entry
from rlhf.errors import CheckpointError
from rlhf.checkpoint.state_file import decode_state, encode_state
from rlhf.testing.distributed import run_distributed


class WritesMarker:
    """Unpickling this creates `path`: the proof that a loader ran code from a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def resign(step_dir: Path, name: str) -> None:
    """Record `name`'s current bytes in the manifest, as an attacker (or a bug after the hash) could."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"][name] = file_entry((step_dir / name).read_bytes())
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


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
    manifest = json.loads((tmp_path / "step_3" / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and sorted(manifest["files"]) == ["rank0.safetensors", "rank1.safetensors"]
    for name, entry in manifest["files"].items():
        assert entry == file_entry((tmp_path / "step_3" / name).read_bytes())


def _save_replicated(root):
    """A subtree every rank holds identically is written once (by the group's first rank) and read by all."""
    manager = CheckpointManager(root)
    rank = dist.get_rank()
    spec = [Replicated(("role", "model"), "role_model", dist.group.WORLD)]
    manager.save(1, {"role": {"model": torch.arange(1000.0), "shard": torch.full((10,), float(rank))}}, replicated=spec)
    state, manifest = manager.load(root / "step_1", replicated=spec)
    return state["role"]["model"].tolist() == list(range(1000)), state["role"]["shard"][0].item(), manifest["files"]


def test_replicated_state_is_written_once_and_read_by_every_rank(tmp_path):
    results = run_distributed(_save_replicated, 2, tmp_path, timeout_s=60)
    assert [r[:2] for r in results] == [(True, 0.0), (True, 1.0)]
    files = results[0][2]
    assert sorted(files) == ["rank0.safetensors", "rank1.safetensors", "role_model.safetensors"]
    assert files["role_model.safetensors"]["size"] > 4000 > files["rank1.safetensors"]["size"]


def _load_in_a_bigger_world(root):
    from rlhf.checkpoint import tensor_folders

    manager = CheckpointManager(root)
    state, manifest = manager.load(root / "step_1")
    folder = tensor_folders(root / "step_1", manifest, "actor")
    return state["x"], folder("model").slice("w")[1:3].tolist(), folder("master").file_of


def test_a_resized_world_reads_the_full_tensors_and_rank_0_state(tmp_path):
    """Saved by one rank, loaded by two: the extra rank takes rank 0's small state; the full tensors (verified
    round robin) serve any slice; an fp32 run's masters are its weights."""
    CheckpointManager(tmp_path).save(1, {"x": 7}, tensors={"actor": {"model": {"w": torch.arange(5.0)}}})
    assert run_distributed(_load_in_a_bigger_world, 2, tmp_path, timeout_s=60) == [
        (7, [1.0, 2.0], {"w": "actor_model_r0.safetensors"})] * 2


def test_interrupted_writes_are_never_picked(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(3, {"x": 1})
    shutil.copytree(tmp_path / "step_3", tmp_path / "step_4.tmp")  # crash before the rename
    (tmp_path / "step_5").mkdir()  # crash before the manifest (cannot happen by protocol, still refused)
    (tmp_path / "step_5" / "rank0.safetensors").write_bytes(encode_state({"x": 5}))
    shutil.copytree(tmp_path / "step_3", tmp_path / "step_6")
    os.remove(tmp_path / "step_6" / "rank0.safetensors")  # a rank file lost
    assert find_latest(tmp_path).name == "step_3"
    (tmp_path / "latest").write_text("step_6")  # a stale pointer is not trusted either
    assert find_latest(tmp_path).name == "step_3"
    assert manager.resolve("none") is None
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume='.*step_5' is not a complete checkpoint"):
        manager.resolve(str(tmp_path / "step_5"))
    assert find_latest(tmp_path / "missing") is None


def test_state_file_round_trips_rng_and_optimizer_like_state_exactly():
    base = torch.arange(10.0)  # two views of one storage, as megatron's optimizer state holds them
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "optimizer": {0: {"exp_avg": base[:5], "step": torch.tensor(3.0)}, 1: {"exp_avg": base[5:]}},
             "groups": [{"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "max": float("inf"), "params": [0, 1]}],
             "by_dtype": {(torch.bfloat16, torch.float32): torch.randn(2, dtype=torch.bfloat16)}, "none": None}
    loaded = decode_state(encode_state(state), "x")
    assert loaded["python"] == state["python"] and loaded["groups"] == state["groups"]
    assert loaded["numpy"][0] == "MT19937" and np.array_equal(loaded["numpy"][1], state["numpy"][1])
    assert loaded["numpy"][2:] == state["numpy"][2:] and torch.equal(loaded["torch"], state["torch"])
    assert loaded["optimizer"][1]["exp_avg"].tolist() == [5.0, 6.0, 7.0, 8.0, 9.0]
    (key, value), = loaded["by_dtype"].items()
    assert key == (torch.bfloat16, torch.float32) and torch.equal(value, state["by_dtype"][key])
    with pytest.raises(TypeError, match=r"state value at state.x has type WritesMarker"):
        encode_state({"x": WritesMarker("/nonexistent")})


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(-64, 0):  # 64 bytes inside the last tensor's record
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped": (_flip, "rank1.safetensors does not match its sha256 in the manifest (corrupted)"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:100]), "rank1.safetensors has 100 bytes, the manifest says"),
    "empty": (lambda p: p.write_bytes(b""), "rank1.safetensors has 0 bytes, the manifest says"),
}


def _corrupt_shards(root: str) -> dict:
    """Each corruption of step_3's rank-1 shard: explicit resume names it on both ranks; auto takes step_2."""
    root = Path(root)
    manager = CheckpointManager(root, keep_last=3)
    for step in (1, 2, 3):
        manager.save(step, {"w": torch.full((1000,), float(step))})
    pristine = (root / "step_3" / "rank1.safetensors").read_bytes()
    skipped: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: skipped.append(record.getMessage())
    logging.getLogger("rlhf.checkpoint").addHandler(handler)
    out = {}
    for kind, (corrupt, _) in CORRUPTIONS.items():
        if dist.get_rank() == 0:
            corrupt(root / "step_3" / "rank1.safetensors")
        dist.barrier()
        try:
            manager.load_for_resume(str(root / "step_3"))
            explicit = None
        except CorruptCheckpointError as error:
            explicit = str(error)
        path, state, _ = manager.load_for_resume("auto")
        out[kind] = (explicit, path.name, state["w"][0].item(), skipped.pop())
        dist.barrier()
        if dist.get_rank() == 0:
            (root / "step_3" / "rank1.safetensors").write_bytes(pristine)
        dist.barrier()
    return out


def test_corrupt_truncated_or_empty_shard_is_named_on_every_rank_and_auto_falls_back(tmp_path):
    results = run_distributed(_corrupt_shards, 2, str(tmp_path), timeout_s=120)
    assert results[0] == results[1], "every rank takes the same decision"
    for kind, (explicit, name, value, skipped) in results[0].items():
        message = CORRUPTIONS[kind][1]
        assert explicit.startswith(f"{tmp_path}/step_3/{message}") and "\n" not in explicit, (kind, explicit)
        assert (name, value) == ("step_2", 2.0), kind
        assert skipped == f"checkpoint: skipping step_3: {explicit}", kind


def test_a_pickle_in_a_checkpoint_never_runs(tmp_path):
    marker = tmp_path / "marker"
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, {"w": torch.ones(2)})
    step = tmp_path / "ckpt" / "step_1"
    (step / "rank0.safetensors").write_bytes(pickle.dumps(WritesMarker(str(marker))))
    resign(step, "rank0.safetensors")  # even with a matching checksum it is parsed, never unpickled
    with pytest.raises(CorruptCheckpointError, match=rf"^{step}/rank0.safetensors is not an rlhf state file"):
        manager.load(step)
    old = tmp_path / "old" / "step_2"  # the pre-manifest format: meta.json + a pickled rank0.pt
    old.mkdir(parents=True)
    (old / "meta.json").write_text(json.dumps({"step": 2, "world_size": 1}))
    torch.save({"model": WritesMarker(str(marker))}, old / "rank0.pt")
    with pytest.raises(CheckpointError, match=r"pickled rank<k>.pt files of an older rlhf are never loaded"):
        CheckpointManager(old.parent).load_for_resume(str(old))
    assert CheckpointManager(old.parent).load_for_resume("auto") is None and find_latest(old.parent) is None
    assert not marker.exists()
    pickle.loads((step / "rank0.safetensors").read_bytes())  # the control: this payload does run code
    assert marker.exists()

"""`rlhf export --run-dir` in one process on crafted runs: a relative model.path is stored absolute (the export from
another working directory keeps the tokenizer; an older config.yaml that holds a relative one warns instead of
silently dropping it), a step pruned by keep_last names what the run holds, a malformed newest manifest is
skipped with one warning naming the step and why, and non-finite weights are refused."""

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402

from rlhf.checkpoint import MANIFEST, CheckpointManager  # noqa: E402
from rlhf.checkpoint.verify import file_entry  # noqa: E402
from rlhf.cli.main import main  # noqa: E402
from rlhf.config.loader import save_config  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=8, num_val=4)


def _run(tmp_path: Path, tiny: dict, model_path: str, keep_last: int = 1) -> Path:
    """A run folder whose checkpoints step_1..3 hold the tiny model's weights (keep_last of them kept)."""
    from transformers import AutoConfig

    cfg = trainer_config({**tiny, "model": model_path}, str(tmp_path / "runs"),
                         [f"checkpoint.keep_last={keep_last}"])
    run = tmp_path / "runs" / "t"
    run.mkdir(parents=True)
    save_config(cfg, run / "config.yaml")
    weights = load_file(Path(tiny["model"]) / "model.safetensors")
    meta = {"hf_configs": {"actor": AutoConfig.from_pretrained(tiny["model"]).to_dict()}}
    manager = CheckpointManager(run / "checkpoints", keep_last=keep_last)
    for step in (1, 2, 3):
        manager.save(step, {"step": step}, meta=meta, tensors={"actor": {"model": dict(weights)}})
    return run


def _export(run: Path, out: Path, *extra: str) -> tuple[int, list[str]]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(["export", "--run-dir", str(run), "--out", str(out), *extra])
    return code, [line for line in stderr.getvalue().splitlines() if line.startswith("rlhf")]


def test_a_relative_model_path_keeps_the_tokenizer_from_any_working_directory(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(Path(tiny["model"]).parent)
    run = _run(tmp_path, tiny, "model")  # relative to the training's working directory
    saved = (run / "config.yaml").read_text()
    assert f"path: {tiny['model']}\n" in saved  # stored absolute
    monkeypatch.chdir(tmp_path)
    assert _export(run, tmp_path / "out") == (0, [])
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    (run / "config.yaml").write_text(saved.replace(f"path: {tiny['model']}\n", "path: model\n"))  # an older run
    code, lines = _export(run, tmp_path / "out_old")
    assert code == 0 and lines == [
        f"rlhf export: warning: model.path='model' in {run}/config.yaml is not a folder from {tmp_path}: the export "
        "has no tokenizer files (run from the training's working directory)"]


def test_a_pruned_step_a_malformed_newest_manifest_and_nan_weights(tiny, tmp_path):
    run = _run(tmp_path, tiny, tiny["model"], keep_last=2)
    ckpt = run / "checkpoints"
    code, lines = _export(run, tmp_path / "out", "--checkpoint", "step_1")
    assert code == 3 and lines == [
        f"rlhf export: error: --checkpoint step_1: no such checkpoint under {ckpt} (it holds step_2, step_3; the "
        "run keeps the newest 2: checkpoint.keep_last); pass one of those or latest"]
    manifest = json.loads((ckpt / "step_3" / MANIFEST).read_text())
    (ckpt / "step_3" / MANIFEST).write_text(json.dumps({**manifest, "step": -3}))
    code, lines = _export(run, tmp_path / "out")
    assert code == 0 and lines == [
        f"rlhf export: warning: checkpoint: skipping step_3: {ckpt}/step_3/{MANIFEST} has step=-3, but its folder is step_3 (a step is an "
        "integer >= 1)"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_size"] == 32
    shard = ckpt / "step_2" / "actor_model_r0.safetensors"
    tensors = load_file(shard)
    tensors["model.norm.weight"][3] = float("inf")
    save_file(tensors, shard, metadata={"format": "pt"})
    manifest = json.loads((ckpt / "step_2" / MANIFEST).read_text())
    manifest["files"][shard.name] = file_entry(shard.read_bytes())  # the checksum matches
    (ckpt / "step_2" / MANIFEST).write_text(json.dumps(manifest))
    code, lines = _export(run, tmp_path / "out_nan", "--checkpoint", "step_2")
    assert code == 3 and lines == [f"rlhf export: error: {shard}: tensor 'model.norm.weight' (model) holds NaN or inf"]
    assert not (tmp_path / "out_nan").exists() and torch.isinf(load_file(shard)["model.norm.weight"]).any()


def _export_on_rank_0_alone(run: str, out: str) -> bool:
    """In a running 2-rank world only rank 0 exports (a training script's hook); its RNG is not reseeded."""
    import torch.distributed as dist

    written = False
    if dist.get_rank() == 0:
        torch.manual_seed(7)
        expected = torch.rand(3)
        torch.manual_seed(7)
        assert main(["export", "--run-dir", run, "--out", out]) == 0
        assert torch.equal(torch.rand(3), expected), "export reseeded the caller's generator"
        written = True
    dist.barrier()
    return written


def test_export_called_by_one_rank_of_a_running_world_writes_without_a_collective(tiny, tmp_path):
    from rlhf.testing.distributed import run_distributed

    run = _run(tmp_path, tiny, tiny["model"])
    out = tmp_path / "out"
    assert run_distributed(_export_on_rank_0_alone, 2, str(run), str(out), timeout_s=120) == [True, False]
    expected = load_file(Path(tiny["model"]) / "model.safetensors")
    shards = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    exported = {name: tensor for shard in shards for name, tensor in load_file(out / shard).items()}
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)

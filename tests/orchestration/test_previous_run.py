"""A relaunch reads its run folder before torch: finished runs say so, another experiment under a reused run.name
is refused, another model in the checkpoint names the likely cause; a raised total_steps resumes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.config import load_config, save_config
from rlhf.errors import ConfigError
from rlhf.orchestration.previous_run import architecture, previous_run_notice
from rlhf.orchestration.schema import RlhfConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    return str(init_hf_model(InitModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                             intermediate_size=64), build_char_tokenizer(),
                             tmp_path_factory.mktemp("m") / "model"))


def _config(tmp_path: Path, model: str, *overrides: str) -> RlhfConfig:
    return load_config(RlhfConfig, None, [f"run.output_dir={tmp_path}", "run.name=exp", f"model.path={model}",
                                          "data.train_files=[a.jsonl]", "trainer.total_steps=3", *overrides])


def _finished_run(tmp_path: Path, cfg: RlhfConfig, step: int = 3, actor: dict | None = None) -> Path:
    """A run folder as rlhf train leaves it: config.yaml and a published checkpoint (manifest + its files)."""
    run = tmp_path / "exp"
    folder = run / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    save_config(cfg, run / "config.yaml")
    (folder / "rank0.safetensors").write_bytes(b"1234")
    models = {"actor": actor or architecture(cfg.model.path)}
    (folder / "manifest.json").write_text(json.dumps({"format": "rlhf-checkpoint/3", "step": step, "world_size": 1,
                                                      "models": models, "files": {"rank0.safetensors": {"size": 4}}}))
    (run / "checkpoints" / "latest").write_text(folder.name)
    return run


def test_finished_unless_total_steps_is_raised(tmp_path, model):
    cfg = _config(tmp_path, model)
    run = _finished_run(tmp_path, cfg)
    assert previous_run_notice(cfg) == (
        f"{run} already finished: its checkpoint is at step 3 and trainer.total_steps=3; raise trainer.total_steps "
        "to train on, or start afresh with another run.name (or checkpoint.resume=none)")
    assert previous_run_notice(_config(tmp_path, model, "trainer.total_steps=5", "mesh.rollout.tp=2")) is None
    assert previous_run_notice(_config(tmp_path, model, "checkpoint.resume=none")) is None
    (run / "checkpoints" / "step_3" / "rank0.safetensors").write_bytes(b"12")  # truncated: not a resumable one
    assert previous_run_notice(cfg) is None


def test_another_experiment_under_a_reused_name_is_refused(tmp_path, model):
    _finished_run(tmp_path, _config(tmp_path, model))
    other = _config(tmp_path, model, "data.train_files=[b.jsonl]", "algo.advantage.kind=rloo")
    with pytest.raises(ConfigError) as error:
        previous_run_notice(other)
    assert str(error.value) == (
        f"{tmp_path / 'exp'} holds another experiment (data.train_files=['a.jsonl'] there, ['b.jsonl'] now; "
        "algo.advantage.kind='grpo' there, 'rloo' now): run.name=exp is reused (recipes fix run.name); set a new "
        "run.name for this run, or checkpoint.resume=<a checkpoint folder> to resume from one anyway")
    asked = _config(tmp_path, model, "data.train_files=[b.jsonl]", "trainer.total_steps=3",
                    f"checkpoint.resume={tmp_path / 'exp/checkpoints/step_3'}")
    assert previous_run_notice(asked).endswith("already finished: its checkpoint is at step 3 and "
                                               "trainer.total_steps=3; raise trainer.total_steps to train on, or "
                                               "start afresh with another run.name (or checkpoint.resume=none)")


def test_a_checkpoint_of_another_model_names_the_reused_run_name(tmp_path, model):
    cfg = _config(tmp_path, model, "trainer.total_steps=9")
    _finished_run(tmp_path, cfg, actor=architecture(model) | {"hidden_size": 576})
    with pytest.raises(ConfigError) as error:
        previous_run_notice(cfg)
    assert str(error.value) == (
        f"checkpoint {tmp_path / 'exp/checkpoints/step_3'} holds another actor model (hidden_size=576 there, 32 in "
        f"model.path={model!r}); run.name=exp is likely reused from another experiment: set a new run.name, or "
        "checkpoint.resume=none to start afresh")


def test_rlhf_train_on_a_finished_run_answers_before_importing_torch(tmp_path, model):
    """The relaunch used to build every model (69 s) to say this; now it is a file read (no torch import)."""
    cfg = _config(tmp_path, model)
    run = _finished_run(tmp_path, cfg)
    save_config(cfg, tmp_path / "c.yaml")
    code = ("import sys; from rlhf.cli.main import main; rc = main(['train', '--config', sys.argv[1]]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch', rc)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.yaml")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "RANK": "0"})
    assert out.stdout.splitlines() == [f"{run} already finished: its checkpoint is at step 3 and trainer.total_steps=3; "
                                       "raise trainer.total_steps to train on, or start afresh with another run.name "
                                       "(or checkpoint.resume=none)", "no torch 0"], out.stderr[-2000:]


def test_the_launcher_answers_for_a_finished_run_without_starting_ranks(tmp_path, model):
    """launch/torchrun.sh's wrapper reads the run folder first: no torch import, no rank started."""
    cfg = _config(tmp_path, model)
    run = _finished_run(tmp_path, cfg)
    save_config(cfg, tmp_path / "c.yaml")
    code = ("import sys; from rlhf.cli.torchrun import main; rc = main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch', rc)")
    out = subprocess.run([sys.executable, "-c", code, "--standalone", "--nproc_per_node=2", "-m", "rlhf", "train",
                          "--config", str(tmp_path / "c.yaml")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert out.stdout.splitlines() == [f"{run} already finished: its checkpoint is at step 3 and trainer.total_steps=3; "
                                       "raise trainer.total_steps to train on, or start afresh with another run.name "
                                       "(or checkpoint.resume=none)", "no torch 0"], out.stderr[-2000:]

"""A failed launch ends with its error line once, last, and an exit code that names the class of error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.cli.failure import exit_code, finish, first_recorded, report
from rlhf.errors import (CheckpointError, CollectiveMismatchError, ConfigError, DataError, NonFiniteError,
                         ProcessGroupError, RewardError)

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **extra}


def test_exit_codes_by_class():
    assert [exit_code(error) for error in (ConfigError(), DataError(), CheckpointError(), RewardError(),
                                           NonFiniteError(), ProcessGroupError(), CollectiveMismatchError(),
                                           RuntimeError())] == [2, 2, 3, 4, 4, 5, 5, 1]


def test_the_first_recorded_line_wins(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLHF_ERROR_DIR", str(tmp_path))
    for rank, line, when_ns in ((1, "rank 1's cause", 5), (0, "rank 0, later", 9), (2, "rank 2, same time", 5)):
        monkeypatch.setenv("RANK", str(rank))
        report(line, 3)
        os.utime(tmp_path / f"rank{rank}", ns=(when_ns, when_ns))
    assert capsys.readouterr().err == ""  # recorded, not printed by the ranks
    assert first_recorded(tmp_path) == (3, "rank 1's cause")
    assert finish(tmp_path, 1) == 3 and capsys.readouterr().err == "rank 1's cause\n"
    (tmp_path / "none").mkdir()
    assert finish(tmp_path / "none", 0) == 0 and capsys.readouterr().err == ""
    assert finish(tmp_path / "none", 7) == 7 and capsys.readouterr().err == (
        "rlhf: the launch failed with exit code 7; see the output above and the run folder's rank<k>.log files\n")


def test_srun_script_ends_with_one_line(tmp_path):
    """launch/srun.sh with a stand-in srun that starts two tasks, each failing on the same bad key."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/usr/bin/env bash\nshift 2\nstatus=0\n"
                                  "for rank in 0 1; do SLURM_PROCID=$rank \"$@\" || status=$?; done\nexit $status\n")
    (bin_dir / "srun").chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "launch/srun.sh"), "train", "trainer.total_step=3"], cwd=tmp_path,
                         env=_env(PATH=f"{bin_dir}:{os.environ['PATH']}"), capture_output=True, text=True, timeout=120)
    line = "rlhf train: error: unknown config key 'trainer.total_step'; did you mean 'total_steps'?"
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")
    assert list(tmp_path.iterdir()) == [bin_dir]  # the error folder is gone


def test_two_rank_launch_of_a_bad_config_ends_with_its_line_once(tmp_path):
    """One launched world: both ranks fail the same preflight; torchrun's ChildFailedError traceback and the
    per-rank copies are gone, the line is last and the exit code is the checkpoint class's (3)."""
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    model = init_hf_model(InitModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                          intermediate_size=64), build_char_tokenizer(), tmp_path / "model")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+2=", "data_source": "x", "reward_model": '
                                          '{"ground_truth": "3"}}\n' * 8)
    out = subprocess.run(["bash", str(ROOT / "launch/torchrun.sh"), "2", "train", "dist.backend=gloo",
                          f"model.path={model}", f"data.train_files={tmp_path / 'train.jsonl'}",
                          "reward.function=reasoning_gym_exact", "data.prompts_per_step=2", "sampling.max_new_tokens=8", "actor.micro_batch_size=4",
                          f"run.output_dir={tmp_path / 'runs'}", f"checkpoint.resume={tmp_path / 'step_7'}"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    line = (f"rlhf train: error: checkpoint.resume={str(tmp_path / 'step_7')!r} is not a complete checkpoint folder "
            "(needs step_<N>/manifest.json and every file it lists)")
    screen = out.stdout + out.stderr
    assert out.returncode == 3, screen[-3000:]
    assert screen.count("rlhf train: error:") == 1 and out.stderr.rstrip("\n").splitlines()[-1] == line
    assert "Traceback" not in screen and "ChildFailedError" not in screen
    assert not (tmp_path / "runs").exists()

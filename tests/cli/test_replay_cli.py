"""`rlhf replay` from the command line: a bad dump folder is one line on stderr, exit 2, and no run folder is
made."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/trainer"))
from fixtures import make_tiny_setup  # noqa: E402


def _replay(args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "rlhf", "replay", *args], env=env, capture_output=True, text=True,
                          timeout=600)  # a guard against a hang only


@pytest.mark.slow  # a whole process start (~15-30 s loaded); the messages are tested in test_rollout_dump.py
def test_bad_rollouts_folder_is_one_line_and_writes_nothing(tmp_path):
    paths = make_tiny_setup(tmp_path / "tiny", num_train=16, num_val=4)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {paths['model']}}}\ndata: {{train_files: [{paths['train']}], prompts_per_step: 4}}\n"
                   f"run: {{output_dir: {tmp_path / 'runs'}}}\ndist: {{backend: gloo}}\ntrainer: {{total_steps: 1}}\n")
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps/step_000001.parquet").write_text("truncated")
    out = _replay(["--rollouts", str(tmp_path / "dumps"), "--config", str(cfg)])
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"rlhf replay: error: rollout dump {tmp_path / 'dumps/step_000001.parquet'} is not a readable parquet file "
        "(ArrowInvalid); point --rollouts at the rollouts/ folder of a run trained with trainer.dump_rollouts=true")
    assert not (tmp_path / "runs").exists()

"""`rlhf doctor` under torchrun on 4 CPU ranks: exits 0 with PASS, reports versions and meshes; bad input fails."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _installed_vllm() -> str:
    """vLLM's own version string when it is importable here (`make install-vllm` adds it), else not installed."""
    if importlib.util.find_spec("vllm") is None:
        return "not installed"
    import vllm

    return vllm.__version__


def _env(tmp_path):
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow  # 4 ranks on 2 cores; `make doctor-ranks` runs the same world
def test_doctor_on_4_ranks_passes(tmp_path):
    out = subprocess.run(
        ["bash", str(ROOT / "launch/torchrun.sh"), "4", "doctor", "--json", "--config",
         str(ROOT / "configs/tiny_cpu.yaml"), "--probe-tensors", "500", f"run.output_dir={tmp_path}",
         "run.name=doc", "mesh.rollout.tp=2"],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{"):])
    assert report["probe"]["status"] == "PASS"
    assert report["world_size"] == 4 and [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    assert report["versions"]["vllm"] == _installed_vllm()
    assert report["versions"]["megatron-core"] == "0.16.1"
    # the meshes `rlhf train` would build for this config: GRPO without KL has no ref
    assert {m["role"]: (m["tp"], m["dp"]) for m in report["meshes"]} == {"actor": (1, 4), "rollout": (2, 2)}
    run_dir = tmp_path / "doc-doctor"  # a training config's run.name=doc: doctor keeps out of that folder
    assert not (tmp_path / "doc").exists() and sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "rank0.log", "rank1.log", "rank2.log",
                                                         "rank3.log"]


def test_bad_override_is_one_line_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlhf", "doctor", "mesh.rolout.tp=2"], cwd=ROOT,
                         env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "rlhf doctor: error: unknown config key 'mesh.rolout'; did you mean 'rollout'?"


def test_launch_scripts_parse():
    for script in sorted((ROOT / "launch").rglob("*.sh")) + sorted((ROOT / "launch").rglob("*.sbatch")):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_bare_doctor_logs_under_the_temp_folder(tmp_path, monkeypatch):
    """A bare `rlhf doctor` used to leave runs/doctor-<time>/ in the working directory."""
    from rlhf.cli.doctor import doctor_config
    from rlhf.cli.main import build_parser

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    parse = build_parser("doctor").parse_args
    assert doctor_config(parse(["doctor"])).run.output_dir == str(tmp_path / "rlhf-doctor")
    assert doctor_config(parse(["doctor", "mesh.rollout.tp=1"])).run.output_dir == str(tmp_path / "rlhf-doctor")
    assert doctor_config(parse(["doctor", "run.output_dir=mine"])).run.output_dir == "mine"
    asked = doctor_config(parse(["doctor", "--config", str(ROOT / "configs/tiny_cpu.yaml")])).run
    assert asked.output_dir == "runs" and asked.name == ""  # doctor-<time> under runs/

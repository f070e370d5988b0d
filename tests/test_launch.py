"""Launch scripts and CI: Slurm opens `--output` before the job script runs, so its folder must exist at submit
time; CI runs every test marker."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sbatch_output_is_in_the_submit_directory():
    scripts = sorted((ROOT / "launch").rglob("*.sbatch"))
    assert scripts
    for script in scripts:
        outputs = re.findall(r"^#SBATCH --(?:output|error)=(\S+)", script.read_text(), re.MULTILINE)
        assert outputs and all("/" not in out for out in outputs), (script.name, outputs)


def test_ci_runs_the_default_then_the_slow_then_the_vllm_suite():
    """The slow suite rotted while nothing ran it: CI runs every marker, `make test` stays the quick one."""
    steps = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert steps == ["make test", "make test-slow", "make test-vllm"]
    makefile = (ROOT / "Makefile").read_text()
    markers = dict(re.findall(r'^(test[\w-]*): .*\n\t\$\(PY\) -m pytest -q -m "([^"]+)"', makefile, re.MULTILINE))
    assert markers == {"test": "not slow and not vllm", "test-slow": "slow and not vllm",
                       "test-vllm": "vllm and not slow"}

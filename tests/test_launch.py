"""Launch scripts: Slurm opens `--output` before the job script runs, so its folder must exist at submit time."""

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

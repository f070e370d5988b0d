"""The config tree loads and checks without torch, so `rlhf train --config bad.yaml` fails at once (it took 25-48 s
when every section's owner module, and torch and megatron behind them, were imported first)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import contextlib, io, json, sys
from pathlib import Path
from rlhf.cli.main import main
from rlhf.config import load_config
from rlhf.orchestration.schema import RlhfConfig
for path in sorted(p for p in Path("configs").rglob("*.yaml") if p.parent.name != "tools"):  # tools/: tool configs
    load_config(RlhfConfig, path)
err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = main(["train", "--config", sys.argv[1], "sampling.n=4"])
heavy = sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "megatron", "transformers"))
print(json.dumps({"code": code, "stderr": err.getvalue(), "heavy": heavy}))
"""


def test_config_errors_come_before_torch_is_imported(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_step: 3\n")
    proc = subprocess.run([sys.executable, "-c", PROBE, str(bad)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 2
    assert result["stderr"] == "rlhf train: error: unknown config key 'trainer.total_step'; did you mean 'total_steps'?\n"
    assert result["heavy"] == []

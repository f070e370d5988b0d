"""`rlhf --help` lists every command without importing torch (it used to take 2-19 s: every command module, and
torch with megatron behind them, were imported to build the parser)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rlhf.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import contextlib, io, json, sys
from rlhf.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(["--help"])
    except SystemExit as done:
        code = done.code
print(json.dumps({"code": code, "help": out.getvalue(), "torch": "torch" in sys.modules}))
"""


def test_help_lists_every_command_without_importing_torch():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0 and not result["torch"]
    words = " ".join(result["help"].split())  # argparse wraps to the terminal width
    for name in COMMANDS:
        assert f" {name} " in words, name
    assert "fake process groups" in words  # `plan`'s summary, read from its module docstring


def test_no_progress_bars_in_a_log_file(tmp_path):
    """transformers' save bar (`Writing model shards ... \\r`) filled log files; a pipe gets plain lines only."""
    proc = subprocess.run([sys.executable, "-m", "rlhf", "init-model", "--out", str(tmp_path / "m")], cwd=ROOT,
                          capture_output=True, timeout=300)  # bytes: text mode would turn `\r` into `\n`
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"wrote {tmp_path / 'm'}\n".encode() and b"\r" not in proc.stderr, proc.stderr

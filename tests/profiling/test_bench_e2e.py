"""The e2e benchmark runs both arms and writes the agreed JSON (slow: TRL and rlhf, a few steps each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_e2e_benchmark_writes_rows_and_summary(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "e2e.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_e2e_vs_trl.py"), "--rounds", "1",
                    "--steps-per-round", "1", "--betas", "0", "--out", str(out)], check=True, env=env, cwd=ROOT,
                   timeout=600)
    result = json.loads(out.read_text())
    assert {"name", "date", "machine", "config", "rows", "summary"} <= set(result)
    (row,) = result["rows"]
    # one warm-up step and one timed step per arm, each generating 8 x 4 x 32 tokens
    assert len(row["rlhf_times_s"]) == len(row["trl_times_s"]) == 2
    assert row["rlhf_gen_tok_s"] == pytest.approx(1024 / row["rlhf_s_step"])
    assert result["summary"] == {"rlhf_vs_trl_tiny_beta0": row["trl_s_step"] / row["rlhf_s_step"]}

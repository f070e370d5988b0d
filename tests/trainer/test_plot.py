"""The demo's before/after summary and curve come from the runs' metrics.jsonl."""

import json

from rlhf.trainer.plot import main


def _write(path, rows):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_and_curve(tmp_path, capsys):
    _write(tmp_path / "sft", [{"step": 1, "sft/loss": 2.0}, {"step": 2, "val/score/mean@1": 0.1}])
    _write(tmp_path / "rl", [{"step": 0, "val/score/mean@1": 0.1},
                             {"step": 1, "critic/score/mean": 0.2, "val/score/mean@1": 0.25},
                             {"step": 2, "critic/score/mean": 0.3, "val/score/mean@1": 0.2}])
    assert main(["--sft", str(tmp_path / "sft"), "--rl", str(tmp_path / "rl"), "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["sft_only_accuracy"], summary["rl_final_accuracy"], summary["rl_best_accuracy"]) == (0.1, 0.2, 0.25)
    assert "after GRPO     : 0.200 (best 0.250, 2 RL steps)" in capsys.readouterr().out
    assert (tmp_path / "curve.png").stat().st_size > 1000

"""The demo's before/after summary and curve come from the runs' metrics.jsonl."""

import json

from rlhf.orchestration.plot import RUN_PANELS, _series, main, plot_run


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
    assert "after GRPO     : 0.200 (best 0.250, 2 RL steps, 0 s of steps)" in capsys.readouterr().out
    assert (tmp_path / "curve.png").stat().st_size > 1000
    assert "sft_more_final_accuracy" not in summary


def test_summary_with_the_equal_compute_sft_arm(tmp_path, capsys):
    """SFT continued from the SFT policy for the RL run's optimizer steps: beside GRPO in the summary and curve."""
    _write(tmp_path / "sft", [{"step": 2, "val/score/mean@1": 0.1}])
    _write(tmp_path / "rl", [{"step": 1, "timing_s/step": 2.0, "val/score/mean@1": 0.25},
                             {"step": 2, "timing_s/step": 3.0, "val/score/mean@1": 0.2}])
    _write(tmp_path / "more", [{"step": 1, "timing_s/step": 0.5, "val/score/mean@1": 0.15},
                               {"step": 2, "timing_s/step": 0.5, "val/score/mean@1": 0.3}])
    assert main(["--sft", str(tmp_path / "sft"), "--rl", str(tmp_path / "rl"), "--sft-more", str(tmp_path / "more"),
                 "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {key: summary[key] for key in ("rl_final_accuracy", "rl_step_time_s", "sft_more_final_accuracy",
                                          "sft_more_best_accuracy", "sft_more_steps", "sft_more_step_time_s")} == {
        "rl_final_accuracy": 0.2, "rl_step_time_s": 5.0, "sft_more_final_accuracy": 0.3,
        "sft_more_best_accuracy": 0.3, "sft_more_steps": 2, "sft_more_step_time_s": 1.0}
    assert ("after more SFT : 0.300 (best 0.300, 2 more SFT steps, 1 s of steps)"
            in capsys.readouterr().out)


def test_run_curve_draws_each_panel_from_what_the_run_logged(tmp_path, capsys):
    rows = [{"step": 0, "val/score/mean@4": 0.1},
            {"step": 1, "critic/score/mean": 0.2, "actor/kl_loss": 0.01, "response_length/mean": 5.0},
            {"step": 2, "critic/score/mean": 0.3, "actor/kl_loss": 0.02, "response_length/mean": 4.0,
             "val/score/mean@4": 0.3}]
    drawn = {title: _series(rows, prefixes) for title, prefixes in RUN_PANELS}
    assert drawn["validation score"] == {"val/score/mean@4": [(0, 0.1), (2, 0.3)]}
    assert drawn["KL to the reference"] == {"actor/kl_loss": [(1, 0.01), (2, 0.02)]}
    assert plot_run(rows, tmp_path) == tmp_path / "curve.png" and (tmp_path / "curve.png").stat().st_size > 1000
    _write(tmp_path / "rl", rows)  # the summary script runs without an SFT run
    assert main(["--rl", str(tmp_path / "rl"), "--out", str(tmp_path)]) == 0
    assert "after SFT only" not in capsys.readouterr().out

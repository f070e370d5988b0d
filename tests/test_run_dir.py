"""Rank 0's console: no progress bar outside a terminal (log files used to fill with `\\r`) but a progress line
every N steps or seconds, and Python warnings (megatron's) go to the rank's log, shown on the console once per
place they are raised."""

from __future__ import annotations

import warnings

from rlhf.run_config import RunConfig
from rlhf.run_dir import close_run, get_logger, progress, setup_run


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=1)


def test_no_progress_bar_when_stdout_is_not_a_terminal(capsys):
    """No `\\r` bar in a log file or pipe (they used to fill with them): plain lines instead."""
    assert list(progress(range(3), desc="rl", clock=lambda: 0.0)) == [0, 1, 2]
    out = capsys.readouterr()
    assert out.out == "rl: 3 done, 0s elapsed\n" and out.err == ""


def test_warnings_reach_the_log_and_the_console_once(tmp_path, capsys):
    original = warnings.showwarning
    run = setup_run(RunConfig(output_dir=str(tmp_path), name="w"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # Python's own default: once per place a warning is raised
            for _ in range(3):
                _warn("full scope is deprecated")
            get_logger("trainer").info("step 1: reward=0")
    finally:
        close_run()
    assert warnings.showwarning is original
    console = capsys.readouterr().out.splitlines()
    assert len(console) == 2 and console[1] == "step 1: reward=0"
    assert console[0].startswith("UserWarning: full scope is deprecated (") and "test_run_dir.py:" in console[0]
    log = (run.path / "rank0.log").read_text()
    assert log.count("full scope is deprecated") == 1 and "WARNING rlhf.warnings" in log


class _Clock:
    """A clock that advances `step_s` each read: progress lines are a function of the count alone."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def test_progress_lines_outside_a_terminal_every_n_steps(tmp_path, capsys):
    run = setup_run(RunConfig(output_dir=str(tmp_path), name="p", progress_every=4, progress_every_s=1e9))
    try:
        assert list(progress(range(10), desc="rl", total=10, tty=False, clock=_Clock(3.0))) == list(range(10))
    finally:
        close_run()
    expected = ["rl: 4/10 (40%), 12s elapsed, eta 18s", "rl: 8/10 (80%), 24s elapsed, eta 6s",
                "rl: 10/10 (100%), 30s elapsed, eta 0s"]
    assert capsys.readouterr().out.splitlines() == expected
    assert [line.split(": ", 1)[1] for line in (run.path / "rank0.log").read_text().splitlines()] == expected


def test_progress_lines_every_n_seconds_and_without_a_run_folder(capsys):
    list(progress(range(5), desc="export", tty=False, every_steps=100, every_s=120.0, clock=_Clock(50.0)))
    assert capsys.readouterr().out.splitlines() == ["export: 3 done, 2m30s elapsed", "export: 5 done, 5m00s elapsed"]


def test_a_failure_traceback_goes_to_the_log_file_only(tmp_path, capsys):
    """`rlhf.cli.main` ends a failure with one line; the console used to print the traceback above it too."""
    from rlhf.run_dir import FILE_ONLY

    run = setup_run(RunConfig(output_dir=str(tmp_path), name="f"))
    try:
        try:
            raise ValueError("warmup")
        except ValueError:
            get_logger("train").exception("train failed", extra={FILE_ONLY: True})
    finally:
        close_run()
    assert capsys.readouterr().out == ""
    log = (run.path / "rank0.log").read_text()
    assert "ERROR rlhf.train: train failed" in log and "Traceback" in log and "ValueError: warmup" in log

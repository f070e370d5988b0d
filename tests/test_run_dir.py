"""Rank 0's console: no progress bar outside a terminal (log files used to fill with `\\r`), and Python warnings
(megatron's) go to the rank's log, shown on the console once per place they are raised."""

from __future__ import annotations

import warnings

from rlhf.run_config import RunConfig
from rlhf.run_dir import close_run, get_logger, progress, setup_run


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=1)


def test_no_progress_bar_when_stdout_is_not_a_terminal(capsys):
    assert list(progress(range(3), desc="rl")) == [0, 1, 2]
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


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

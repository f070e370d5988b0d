"""How a failed command ends: one line naming the error, once for the whole launch, and an exit code by class.

Exit codes (also in docs/troubleshooting.md):
    0  success (a finished run relaunched included)
    1  an unexpected failure: a bug or the environment; the traceback is in the rank logs
    2  bad input: a config value, a data file, a CLI argument (ConfigError, DataError)
    3  a checkpoint that is missing, incomplete or of another model (CheckpointError)
    4  training stopped: a reward function failed, or a non-finite loss under nan_policy=abort
    5  the ranks could not work together: a rank missing or unreachable, mismatched collectives

Under the launch scripts every rank records its line in `$RLHF_ERROR_DIR` instead of printing it; the launcher
prints the first one recorded (rank order on a tie), last, and exits with its code.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlhf.errors import (CheckpointError, CollectiveMismatchError, ConfigError, DataError, NonFiniteError,
                         ProcessGroupError, RewardError)

ERROR_DIR_ENV = "RLHF_ERROR_DIR"
EXIT_CODES = ((ConfigError, 2), (DataError, 2), (CheckpointError, 3), (RewardError, 4), (NonFiniteError, 4),
              (ProcessGroupError, 5), (CollectiveMismatchError, 5))


def exit_code(error: BaseException) -> int:
    return next((code for kind, code in EXIT_CODES if isinstance(error, kind)), 1)


def launch_rank() -> int:
    """This process's rank as the launcher set it (torchrun's RANK, Slurm's SLURM_PROCID; 0 alone), before any
    process group exists."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def report(line: str, code: int) -> None:
    """Print `line` to stderr, or, under a launcher that collects them, record it for the launcher to print."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        print(line, file=sys.stderr, flush=True)
        return
    path = Path(folder) / f"rank{launch_rank()}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{code}\n{line}\n")
    os.replace(tmp, path)


def first_recorded(folder: str | os.PathLike) -> tuple[int, str] | None:
    """(exit code, line) of the first rank that recorded one, by time, then rank; None when none did."""
    records = [(path.stat().st_mtime_ns, int(path.name[4:]), path) for path in Path(folder).glob("rank*")
               if path.name[4:].isdigit()]
    if not records:
        return None
    code, line = min(records)[2].read_text().split("\n", 1)
    return int(code), line.rstrip("\n")


def finish(folder: str | os.PathLike, launcher_code: int) -> int:
    """The launch's last line and exit code: the first recorded error, else the launcher's own code."""
    found = first_recorded(folder)
    if found is None:
        if launcher_code:
            print(f"rlhf: the launch failed with exit code {launcher_code}; see the output above and the run "
                  "folder's rank<k>.log files", file=sys.stderr, flush=True)
        return launcher_code
    code, line = found
    print(line, file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":  # launch/srun.sh: python -m rlhf.cli.failure ERROR_DIR SRUN_EXIT_CODE
    raise SystemExit(finish(sys.argv[1], int(sys.argv[2])))

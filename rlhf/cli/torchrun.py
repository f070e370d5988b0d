"""`python -m rlhf.cli.torchrun [torchrun args] -m rlhf ...`: torchrun whose failure ends in one line.

The ranks record their error lines (`rlhf.cli.failure`) instead of printing one each; torchrun's own
ChildFailedError traceback and its per-worker error log are left out; the first recorded line is printed last
and its exit code (by error class) is the launch's. A relaunched `train` of a finished run says so before
torch is imported and starts no rank.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

from rlhf.cli.failure import ERROR_DIR_ENV, finish


def finished_notice(argv: list[str]) -> str | None:
    """The finished-run notice of an `-m rlhf train ...` command line, read from its run folder (no torch); any
    problem with the arguments is left to the ranks, which report it."""
    if "-m" not in argv or argv[argv.index("-m") + 1:argv.index("-m") + 3] != ["rlhf", "train"]:
        return None
    from rlhf.cli.common import config_from_args
    from rlhf.cli.main import build_parser
    from rlhf.errors import RlhfError
    from rlhf.orchestration.previous_run import previous_run_notice

    try:
        return previous_run_notice(config_from_args(build_parser("train").parse_args(argv[argv.index("-m") + 2:])))
    except (RlhfError, SystemExit):
        return None


def main(argv: list[str]) -> int:
    notice = finished_notice(argv)
    if notice is not None:
        print(notice, flush=True)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # "failed (exitcode: 2) ..."
    with tempfile.TemporaryDirectory(prefix="rlhf-errors-") as folder:
        os.environ[ERROR_DIR_ENV] = folder
        try:
            run(parse_args(argv))
        except ChildFailedError as error:
            _, first = min(error.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
            return finish(folder, first.exitcode if first.exitcode > 0 else 1)  # < 0: killed by a signal
        return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

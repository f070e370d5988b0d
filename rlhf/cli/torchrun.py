"""`python -m rlhf.cli.torchrun [torchrun args] -m rlhf ...`: torchrun whose failure ends in one line.

The ranks record their error lines (`rlhf.cli.failure`) instead of printing one each; torchrun's own
ChildFailedError traceback and its per-worker error log are left out; the first recorded line is printed last
and its exit code (by error class) is the launch's.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

from rlhf.cli.failure import ERROR_DIR_ENV, finish


def main(argv: list[str]) -> int:
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

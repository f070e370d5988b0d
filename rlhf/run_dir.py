"""One folder per run: the resolved config, `rank<k>.log` from every rank, metrics. Rank 0 alone talks to the console.

    runs/<name>/config.yaml     resolved config (rank 0 writes it)
    runs/<name>/rank<k>.log     every rank's log, including warnings and tracebacks
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from tqdm import tqdm

from rlhf.errors import ConfigError
from rlhf.run_config import RunConfig

T = TypeVar("T")
LOGGER_NAME = "rlhf"
_FORMAT = "%(asctime)s rank%(rank)s %(levelname)s %(name)s: %(message)s"
_CONSOLE = "rlhf-console"
FILE_ONLY = "file_only"  # `extra={FILE_ONLY: True}`: the record goes to the rank's log file, not the console


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def _agreed_name(cfg: RunConfig, prefix: str) -> str:
    """Rank 0 picks the default name; the others take it from rank 0 so all write to one folder."""
    if cfg.name:
        return cfg.name
    name = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        from rlhf.parallel.wire import broadcast_json

        name = broadcast_json(name, src=0)
    return name


@dataclass
class RunDir:
    path: Path
    rank: int
    pending_config: Any = None

    def commit_config(self) -> None:
        """Write the resolved config held back by `setup_run(defer_config=True)` (rank 0; once)."""
        if self.rank == 0 and self.pending_config is not None:
            _save_config(self.pending_config, self.path / "config.yaml")
        self.pending_config = None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def file(self, name: str) -> Path:
        return self.path / name


def _save_config(resolved_config: Any, path: Path) -> None:
    from rlhf.config.loader import save_config  # late: rlhf.config imports this module's RunConfig

    save_config(resolved_config, path)


def setup_run(cfg: RunConfig, resolved_config: Any = None, prefix: str = "run", defer_config: bool = False) -> RunDir:
    """Create the run folder, route this rank's logs into it, and save the resolved config (rank 0).

    `defer_config` holds the config back until `RunDir.commit_config()`: a resume keeps the run's config.yaml
    until every resume check has passed (export reads it)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = Path(cfg.output_dir) / _agreed_name(cfg, prefix)
    path.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(cfg.log_level.upper())
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    rank_filter = _RankFilter(rank)
    file_handler = logging.FileHandler(path / f"rank{rank}.log")
    file_handler.setFormatter(logging.Formatter(_FORMAT))
    file_handler.addFilter(rank_filter)
    logger.addHandler(file_handler)
    if rank == 0:
        console = _ConsoleHandler(sys.stdout)
        console.progress_every, console.progress_every_s = cfg.progress_every, cfg.progress_every_s
        console.set_name(_CONSOLE)
        console.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(console)
    logger.propagate = False
    warnings.showwarning = _log_warning
    run_dir = RunDir(path=path, rank=rank, pending_config=resolved_config)
    if not defer_config:
        run_dir.commit_config()
    return run_dir


def check_inside(path: Path, run: Path, what: str) -> None:
    """ConfigError when `path` below the run folder `run`, or a folder between them, is a symlink leading out of
    `run`: rlhf never reads, writes or deletes through one (a resume would clear another folder's files)."""
    inside, current = run.resolve(), run
    for part in path.relative_to(run).parts:
        current = current / part
        if current.is_symlink() and not current.resolve().is_relative_to(inside):
            raise ConfigError(f"{what} {current} is a symlink to {os.readlink(current)}, outside the run folder; "
                              "rlhf never writes or deletes through one: remove the link or make it a real folder")


def get_logger(name: str = "") -> logging.Logger:
    return logging.getLogger(f"{LOGGER_NAME}.{name}" if name else LOGGER_NAME)


def quiet_console() -> None:
    """Rank 0's console shows warnings and errors only (`trainer.logger` without console); rank0.log keeps all."""
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        if handler.get_name() == _CONSOLE:
            handler.setLevel(logging.WARNING)


def close_run() -> None:
    """Flush and close this rank's log handlers (called on teardown, also after errors)."""
    warnings.showwarning = _SHOW_WARNING
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        handler.flush()
        handler.close()
        logger.removeHandler(handler)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def progress_line(desc: str, done: int, total: int | None, elapsed_s: float) -> str:
    """`rl: 10/200 (5%), 1m02s elapsed, eta 19m38s` (no total: the count and the elapsed time)."""
    if not total:
        return f"{desc}: {done} done, {_clock(elapsed_s)} elapsed"
    eta = elapsed_s / done * (total - done) if done else 0.0
    return f"{desc}: {done}/{total} ({100 * done // total}%), {_clock(elapsed_s)} elapsed, eta {_clock(eta)}"


def _console() -> "_ConsoleHandler | None":
    return next((h for h in logging.getLogger(LOGGER_NAME).handlers if isinstance(h, _ConsoleHandler)), None)


def progress(items: Iterable[T], desc: str, total: int | None = None, *, every_steps: int | None = None,
             every_s: float | None = None, tty: bool | None = None, clock=time.monotonic) -> Iterator[T]:
    """Rank 0 only: a progress bar on a terminal; elsewhere (a Slurm log, a pipe) one line every `every_steps`
    items or `every_s` seconds and at the end, to the console and rank0.log (defaults: the run's
    `run.progress_every` / `run.progress_every_s`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        yield from items
        return
    if sys.stdout.isatty() if tty is None else tty:  # the step lines are printed above it (`_ConsoleHandler`)
        yield from tqdm(items, desc=desc, total=total, dynamic_ncols=True, file=sys.stdout)
        return
    console = _console()
    every_steps = every_steps or (console.progress_every if console else 10)
    every_s = every_s or (console.progress_every_s if console else 60.0)
    write = get_logger("progress").info if console else (lambda line: print(line, flush=True))
    start = last = clock()
    done = printed = 0
    for item in items:
        yield item
        done += 1
        now = clock()
        if done % every_steps == 0 or now - last >= every_s or done == total:
            write(progress_line(desc, done, total, now - start))
            last, printed = now, done
    if done != printed:  # no total: the count at the end
        write(progress_line(desc, done, total, clock() - start))


class _ConsoleHandler(logging.StreamHandler):
    """Rank 0's console: each line goes through `tqdm.write`, so a live progress bar is redrawn below it; it
    carries the run's progress-line cadence for `progress` outside a terminal."""

    progress_every: int = 10
    progress_every_s: float = 60.0

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, FILE_ONLY, False):
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


_SHOW_WARNING = warnings.showwarning


def _log_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
    """Python warnings (megatron's among them) go to this rank's log; only rank 0's reach the console, and
    the warnings registry shows each one once per place it is raised."""
    get_logger("warnings").warning("%s: %s (%s:%d)", category.__name__, message, filename, lineno)

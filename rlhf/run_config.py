"""Config sections of a run's folder and its checkpoints, free of torch (the owners: run_dir.py, checkpoint.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlhf.errors import ConfigError


@dataclass(kw_only=True)
class RunConfig:
    """Run identity and output location; an empty name becomes `<prefix>-<UTC time>` (agreed by all ranks).
    Outside a terminal rank 0 prints a progress line every `progress_every` steps or `progress_every_s` seconds."""

    name: str = ""  # the run's folder name under output_dir; empty: `<command>-<UTC time>`
    output_dir: str = "runs"  # where run folders are created (`~` is expanded)
    log_level: str = "INFO"  # level of the console and of every rank's log file
    progress_every: int = 10  # outside a terminal: a progress line (with ETA) every this many steps...
    progress_every_s: float = 60.0  # ...or this many seconds, whichever comes first

    def __post_init__(self) -> None:
        self.output_dir = os.path.expanduser(self.output_dir)
        if self.progress_every < 1 or not self.progress_every_s > 0:
            raise ConfigError(f"run.progress_every={self.progress_every} and run.progress_every_s="
                              f"{self.progress_every_s} must be >= 1 and > 0")
        if "/" in self.name or self.name in (".", ".."):
            raise ConfigError(f"run.name={self.name!r} must be a plain folder name (no '/')")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"run.log_level={self.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR")


@dataclass(kw_only=True)
class CheckpointConfig:
    """`every` steps (0 = only at the end); keep the newest `keep_last`; `resume`: auto | none | a folder path;
    `async_save`: write while the next step trains (published at the next step boundary); `save_hf_every`: an HF
    copy of the actor under `<run>/hf/step_<N>` every that many steps (0 = never)."""

    every: int = 0  # save every N steps; 0 saves only at the end
    keep_last: int = 2  # how many of the newest checkpoints are kept
    resume: str = "auto"  # auto: the newest complete checkpoint of this run's folder; none; or a checkpoint folder
    save_at_end: bool = True  # save after the last step (also when `every` is 0)
    async_save: bool = False  # write shards from a thread while training goes on; published at the next step
    save_hf_every: int = 0  # an HF copy of the actor under <run>/hf/step_<N> every N steps; 0: never

    def __post_init__(self) -> None:
        self.resume = os.path.expanduser(self.resume)
        if self.every < 0:
            raise ConfigError(f"checkpoint.every={self.every} must be >= 0 (0 saves only at the end)")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 1")
        if self.save_hf_every < 0:
            raise ConfigError(f"checkpoint.save_hf_every={self.save_hf_every} must be >= 0 (0 writes no HF copies)")

"""Crash-safe checkpoints: `<run>/checkpoints/step_<N>/` with one state file per rank plus `meta.json`.

Write protocol (DESIGN.md §10): every rank writes `rank<k>.pt` into `step_<N>.tmp/` and fsyncs it; after a
barrier rank 0 writes `meta.json`, renames the folder to `step_<N>`, then rewrites `latest` (temp file + rename)
and prunes beyond `keep_last`. So a folder without `meta.json`, or still named `.tmp`, is never complete, and
`resume: auto` only ever picks complete ones. Resume needs the same world size and layouts (recorded in meta);
to change layouts, export to HF and import again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf.errors import CheckpointError, ConfigError

STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"
LATEST = "latest"


@dataclass(kw_only=True)
class CheckpointConfig:
    """`every` steps (0 = only at the end); keep the newest `keep_last`; `resume`: auto | none | a folder path."""

    every: int = 0
    keep_last: int = 2
    resume: str = "auto"
    save_at_end: bool = True

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every={self.every} must be >= 0 (0 saves only at the end)")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 1")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, write) -> None:
    """Write via `write(file)` to `path` and fsync it before returning."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def is_complete(step_dir: Path) -> bool:
    meta_path = step_dir / META
    if not STEP_DIR.match(step_dir.name) or not meta_path.is_file():
        return False
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return all((step_dir / f"rank{k}.pt").is_file() for k in range(meta.get("world_size", -1)))


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (trusting `latest` only if it names a complete one)."""
    if not root.is_dir():
        return None
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        if is_complete(named):
            return named
    complete = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return max(complete, key=lambda p: int(STEP_DIR.match(p.name).group(1)), default=None)


class CheckpointManager:
    """Saves and restores per-rank state dicts under `<run>/checkpoints/`. All ranks call every method."""

    def __init__(self, root: str | Path, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None) -> Path:
        """Collective: write this rank's `state`; rank 0 publishes the folder once every rank has written."""
        rank, world = _rank(), _world()
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted write
            tmp.mkdir()
        _barrier()
        _write_durable(tmp / f"rank{rank}.pt", lambda f: torch.save(state, f))
        _barrier()
        if rank == 0:
            record = {"step": step, "world_size": world, "time": time.time(), **(meta or {})}
            _write_durable(tmp / META, lambda f: f.write(json.dumps(record, indent=2).encode()))
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            latest_tmp = self.root / f"{LATEST}.tmp"
            _write_durable(latest_tmp, lambda f: f.write(final.name.encode()))
            os.replace(latest_tmp, self.root / LATEST)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        complete = sorted((p for p in self.root.iterdir() if p.is_dir() and is_complete(p)),
                          key=lambda p: int(STEP_DIR.match(p.name).group(1)))
        for old in complete[:-self.keep_last]:
            shutil.rmtree(old)

    def resolve(self, resume: str) -> Path | None:
        """`auto` -> newest complete checkpoint or None; `none` -> None; else that folder (must be complete)."""
        if resume == "none":
            return None
        if resume == "auto":
            return find_latest(self.root)
        path = Path(resume)
        if not is_complete(path):
            raise CheckpointError(f"checkpoint.resume={resume!r} is not a complete checkpoint folder "
                                  f"(needs step_<N>/meta.json and every rank<k>.pt)")
        return path

    def load(self, path: Path, expected_meta: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict]:
        """This rank's state and the checkpoint's meta; meta keys in `expected_meta` must match exactly."""
        meta = json.loads((path / META).read_text())
        if meta["world_size"] != _world():
            raise CheckpointError(f"checkpoint {path} was written by {meta['world_size']} ranks, this run has "
                                  f"{_world()}; resume with the same world size or export to HF and re-import")
        for key, want in (expected_meta or {}).items():
            if meta.get(key) != want:
                raise CheckpointError(f"checkpoint {path} has {key}={meta.get(key)!r} but this run has {want!r}; "
                                      f"resume with the same setting or export to HF and re-import")
        state = torch.load(path / f"rank{_rank()}.pt", map_location="cpu", weights_only=False)
        return state, meta

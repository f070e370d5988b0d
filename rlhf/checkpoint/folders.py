"""Where a run's checkpoints lie and which are published: `<run>/checkpoints/step_<N>/` folders, `latest`, each
folder's `manifest.json` (the commit point) read and checked against the files it lists. Pure file system
reads, no process group: `rlhf export` and the manager's save, prune and resume all find steps through here."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from rlhf.checkpoint.verify import manifest_problem
from rlhf.errors import CheckpointError
from rlhf.run_dir import get_logger

STEP_DIR = re.compile(r"^step_(\d{1,18})$")  # bounded: int() of a crafted 5000-digit name is refused
MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "rlhf-checkpoint/3"  # 2: per-layout model files; 1: pickled rank<k>.pt (never loaded: they can run code)
log = get_logger("checkpoint")


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files do not verify against its manifest (`resume: auto` falls back past it)."""


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def _step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def old_format_note(step_dir: Path) -> str:
    """A note for folders of the pickle format (meta.json + rank<k>.pt), which are never loaded."""
    if not (step_dir / "meta.json").is_file():
        return ""
    return " (pickled rank<k>.pt files of an older rlhf are never loaded: they could run code)"


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The manifest of a published checkpoint; CorruptCheckpointError saying why it is not one."""
    path = step_dir / MANIFEST
    if not path.is_file():
        raise CorruptCheckpointError(f"{step_dir} has no {MANIFEST}: not a complete checkpoint"
                                     f"{old_format_note(step_dir)}")
    if path.is_symlink():
        raise CorruptCheckpointError(f"{path} is a symlink; a checkpoint's files are never read through one")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:  # ValueError: also a >4300-digit int
        raise CorruptCheckpointError(f"{path} is unreadable ({type(error).__name__}: {str(error)[:200]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path} is not an {FORMAT} manifest")
    match = STEP_DIR.match(step_dir.name)
    problem = manifest_problem(manifest, int(match.group(1)) if match else None)
    if problem:
        raise CorruptCheckpointError(f"{path} {problem}")
    for name, entry in manifest["files"].items():
        file = step_dir / name
        if file.is_symlink():
            raise CorruptCheckpointError(f"{file} is a symlink; a checkpoint's files are never read through one")
        if not file.is_file():
            raise CorruptCheckpointError(f"{file} is listed in the manifest but missing")
        if file.stat().st_size != entry.get("size"):
            raise CorruptCheckpointError(f"{file} has {file.stat().st_size} bytes, the manifest says "
                                         f"{entry.get('size')} (truncated or replaced)")
    return manifest


def is_complete(step_dir: Path) -> bool:
    """Published (`step_<N>` with a manifest) and every listed file present at its size; contents unchecked."""
    if not STEP_DIR.match(step_dir.name):
        return False
    try:
        read_manifest(step_dir)
    except CorruptCheckpointError:
        return False
    return True


def check_root(root: Path) -> None:
    """CheckpointError when the checkpoints folder is a symlink: pruning through it would delete another run's."""
    if root.is_symlink():
        raise CheckpointError(f"{root} is a symlink (to {os.readlink(root)}); rlhf never reads, writes or prunes "
                              "checkpoints through a symlink out of the run folder: make it a real folder")


def step_folders(root: Path) -> list[Path]:
    """The `step_<N>` folders under `root`, oldest first; a symlinked one is skipped with a warning, never read."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if not STEP_DIR.match(path.name):
            continue
        if path.is_symlink():
            log.warning("checkpoint: skipping %s: a symlink (to %s); checkpoints are never read through one",
                        path.name, os.readlink(path))
        elif path.is_dir():
            found.append(path)
    return sorted(found, key=_step_of)


def _check_latest(root: Path) -> None:
    """Warn when `latest` is not a plain `step_<N>` name (a path would point outside the run); never followed."""
    latest = root / LATEST
    if latest.is_symlink() or not latest.is_file():
        return
    name = latest.read_text(errors="replace").strip()
    if not STEP_DIR.match(name):
        log.warning("checkpoint: ignoring %s: it holds %r, not a step_<N> name", latest, name[:300])


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, logging each newer folder it skips and why (`latest` is
    checked to be a plain name; the folders decide)."""
    check_root(root)
    _check_latest(root)
    for path in reversed(step_folders(root)):
        try:
            read_manifest(path)
            return path
        except CorruptCheckpointError as error:
            log.warning("checkpoint: skipping %s: %s", path.name, error)
    return None

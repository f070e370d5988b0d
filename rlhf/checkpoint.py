"""Crash-safe, verified checkpoints: `<run>/checkpoints/step_<N>/` with one state file per rank plus a manifest.

Write protocol (DESIGN.md §10): every rank writes `rank<k>.safetensors` (tensors + a JSON state tree, never a
pickle: `rlhf.state_file`) into `step_<N>.tmp/` and fsyncs it; state identical across a group (a role's model and
replicated optimizer across its DP replicas) is cut out and written once, by the group's first rank, as
`<name>.safetensors` (`Replicated`), so bytes do not grow with DP. Rank 0 then writes `manifest.json` (every file's
size and sha256, the world size, layouts and model) last, renames the folder to `step_<N>`, rewrites `latest`
(temp file + rename) and prunes beyond `keep_last`. The manifest is the commit point: a folder without one is
never complete. On load every rank verifies its file against the manifest before any state is used and all ranks
agree on the verdict; `resume: auto` falls back to the newest checkpoint that verifies. Resume needs the same
world size and layouts (recorded in the manifest); to change layouts, export to HF and import again.
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

import torch.distributed as dist

from rlhf.checkpoint_verify import agree, all_gather_json, entry_problem, file_entry
from rlhf.errors import CheckpointError
from rlhf.run_dir import get_logger
from rlhf.state_file import decode_state, encode_state

STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "rlhf-checkpoint/2"  # 1 was pickled rank<k>.pt files with meta.json: never loaded (they can run code)
log = get_logger("checkpoint")


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files do not verify against its manifest (`resume: auto` falls back past it)."""


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


def _write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def _step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def _old_format(step_dir: Path) -> str:
    """A note for folders of the pickle format (meta.json + rank<k>.pt), which are never loaded."""
    if not (step_dir / "meta.json").is_file():
        return ""
    return " (pickled rank<k>.pt files of an older rlhf are never loaded: they could run code)"


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The manifest of a published checkpoint; CorruptCheckpointError saying why it is not one."""
    path = step_dir / MANIFEST
    if not path.is_file():
        raise CorruptCheckpointError(f"{step_dir} has no {MANIFEST}: not a complete checkpoint{_old_format(step_dir)}")
    try:
        manifest = json.loads(path.read_text())
        files, world = manifest["files"], manifest["world_size"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(f"{path} is unreadable ({type(error).__name__}: {error})") from None
    if manifest.get("format") != FORMAT or not isinstance(files, dict) or not isinstance(world, int):
        raise CorruptCheckpointError(f"{path} is not an {FORMAT} manifest")
    for name, entry in files.items():
        file = step_dir / name
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{path} has a malformed entry for {name!r}")
        if "/" in name or not file.is_file():
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
    return max(complete, key=_step_of, default=None)


@dataclass(frozen=True)
class Replicated:
    """The subtree at `path` of every rank's state is identical across `group` (a role's DP replicas): it is
    written once, by the group's first rank, as `<name>.safetensors`, and read back by every rank of the group."""

    path: tuple[str, ...]
    name: str
    group: dist.ProcessGroup | None = None

    @property
    def file(self) -> str:
        return f"{self.name}.safetensors"

    def writes(self) -> bool:
        first = dist.get_process_group_ranks(self.group)[0] if self.group is not None else 0
        return first == _rank()


def _split(state: dict[str, Any], replicated: list[Replicated]) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """This rank's own state without the replicated subtrees, and the (file, subtree) pairs it writes."""
    local = dict(state)
    shared = []
    for spec in replicated:
        parent = local
        for key in spec.path[:-1]:
            parent[key] = dict(parent[key])
            parent = parent[key]
        subtree = parent.pop(spec.path[-1])
        if spec.writes():
            shared.append((spec.file, subtree))
    return local, shared


def _insert(state: dict[str, Any], path: tuple[str, ...], subtree: Any) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = subtree


def _check_meta(path: Path, manifest: dict, expected: dict[str, Any]) -> None:
    if manifest["world_size"] != _world():
        raise CheckpointError(f"checkpoint {path} was written by {manifest['world_size']} ranks, this run has "
                              f"{_world()}; resume with the same world size or export to HF and re-import")
    for key, want in expected.items():
        if manifest.get(key) != want:
            raise CheckpointError(f"checkpoint {path} has {key}={manifest.get(key)!r} but this run has "
                                  f"{want!r}; resume with the same setting or export to HF and re-import")


def _read_verified(file: Path, manifest: dict) -> Any:
    """A state file, parsed only after its bytes matched the manifest's size and sha256."""
    try:
        data = file.read_bytes()
    except OSError as error:
        raise CorruptCheckpointError(f"{file} is unreadable ({error.strerror})") from None
    problem = entry_problem(str(file), data, manifest["files"].get(file.name))
    if problem:
        raise CorruptCheckpointError(problem)
    try:
        return decode_state(data, str(file))
    except CheckpointError as error:
        raise CorruptCheckpointError(str(error)) from None


class CheckpointManager:
    """Saves and restores per-rank state under `<run>/checkpoints/`. All ranks call every method."""

    def __init__(self, root: str | Path, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None,
             replicated: list[Replicated] = ()) -> Path:
        """Collective: write this rank's `state` (each `replicated` subtree once per group); rank 0 commits the
        manifest once every rank has written."""
        rank, world = _rank(), _world()
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted write
            tmp.mkdir()
        _barrier()
        local, shared = _split(state, list(replicated))
        entries = []
        for name, tree in [(rank_file(rank), local), *shared]:
            data = encode_state(tree)
            _write_durable(tmp / name, data)
            entries.append([name, file_entry(data)])
        written = [entry for per_rank in all_gather_json(entries) for entry in per_rank]
        files = dict(written)
        assert len(files) == len(written), f"two ranks wrote one file: {sorted(name for name, _ in written)}"
        if rank == 0:
            record = {"format": FORMAT, "step": step, "world_size": world, "time": time.time(), **(meta or {}),
                      "files": files}
            _write_durable(tmp / MANIFEST, json.dumps(record, indent=2).encode())
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            latest_tmp = self.root / f"{LATEST}.tmp"
            _write_durable(latest_tmp, final.name.encode())
            os.replace(latest_tmp, self.root / LATEST)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        complete = sorted((p for p in self.root.iterdir() if p.is_dir() and is_complete(p)), key=_step_of)
        for old in complete[:-self.keep_last]:
            shutil.rmtree(old)

    def resolve(self, resume: str) -> Path | None:
        """`auto` -> newest complete checkpoint or None; `none` -> None; else that folder (must be complete)."""
        if resume == "none":
            return None
        if resume == "auto":
            return find_latest(self.root)
        path = Path(resume)
        if not STEP_DIR.match(path.name) or not (path / MANIFEST).is_file():
            raise CheckpointError(f"checkpoint.resume={resume!r} is not a complete checkpoint folder "
                                  f"(needs step_<N>/{MANIFEST} and every file it lists){_old_format(path)}")
        return path

    def load(self, path: Path, expected_meta: dict[str, Any] | None = None,
             replicated: list[Replicated] = ()) -> tuple[dict[str, Any], dict]:
        """Collective: this rank's state (with its `replicated` subtrees) and the manifest, after every rank
        verified the files it reads (sizes, sha256).

        Manifest keys in `expected_meta` must match exactly (CheckpointError); a file that does not verify is a
        CorruptCheckpointError naming it, raised on every rank.
        """
        state, failure = None, None
        try:
            manifest = read_manifest(path)
            _check_meta(path, manifest, expected_meta or {})
            state = _read_verified(path / rank_file(_rank()), manifest)
            for spec in replicated:
                _insert(state, spec.path, _read_verified(path / spec.file, manifest))
        except CheckpointError as error:
            failure = [isinstance(error, CorruptCheckpointError), str(error)]
        failure = agree(failure)
        if failure:
            raise (CorruptCheckpointError if failure[0] else CheckpointError)(failure[1])
        return state, manifest

    def load_for_resume(self, resume: str, expected_meta: dict[str, Any] | None = None,
                        replicated: list[Replicated] = ()) -> tuple[Path, dict[str, Any], dict] | None:
        """Collective: the checkpoint `resume` names, loaded and verified; `auto` takes the newest that verifies,
        logging each newer one it skips and why. None when there is nothing to resume."""
        if resume != "auto":
            path = self.resolve(resume)
            return None if path is None else (path, *self.load(path, expected_meta, replicated))
        for name in self._candidates():
            path = self.root / name
            try:
                return (path, *self.load(path, expected_meta, replicated))
            except CorruptCheckpointError as error:
                log.warning("checkpoint: skipping %s: %s", name, error)
        return None

    def _candidates(self) -> list[str]:
        """Published step folders, newest first, as rank 0 sees them (so every rank tries the same ones)."""
        names = sorted((p.name for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                       key=lambda n: -int(STEP_DIR.match(n).group(1))) if self.root.is_dir() else []
        return all_gather_json(names)[0]

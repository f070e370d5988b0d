"""Crash-safe, verified, reshardable checkpoints: `<run>/checkpoints/step_<N>/` with state files and a manifest.

Write protocol (DESIGN.md §10): every rank writes `rank<k>.safetensors` (its small state: tensors + a JSON tree,
never a pickle: `state_file`) into `step_<N>.tmp/`; a role's weights and optimizer state arrive as full
tensors under HF names (`rlhf.train.state`), each kept by one rank and written to `<role>_<kind>_r<k>.safetensors`,
so bytes do not grow with DP and any layout can read them back. State identical across a group can also be cut
out and written once (`Replicated`). When every rank has written (at once, or with `async_save` at the next
commit: the files are written by a thread meanwhile), rank 0 writes `manifest.json` (every file's size and
sha256, the tensor index, world size, layouts, models) last, renames the folder to `step_<N>`, rewrites `latest`
(temp file + rename) and prunes beyond `keep_last`. The manifest is the commit point: a folder without one is
never complete, so a crash or failed write mid-save leaves the previous checkpoint as latest. On load the ranks
verify the files between them against the manifest before any state is used and agree on the verdict;
`resume: auto` falls back to the newest checkpoint that verifies.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rlhf.checkpoint.folders import (FORMAT, LATEST, MANIFEST, STEP_DIR, CorruptCheckpointError, check_root,
                                     find_latest, is_complete, old_format_note, rank_file, read_manifest,
                                     step_folders)
from rlhf.checkpoint.verify import agree, entry_problem, file_problem, tensor_file_problem
from rlhf.checkpoint.write import Writer, fsync_dir, write_durable
from rlhf.errors import CheckpointError
from rlhf.models.hf_load import HfFolder
from rlhf.parallel.wire import all_gather_json
from rlhf.run_dir import get_logger
from rlhf.checkpoint.state_file import decode_state, encode_state

RoleTensors = dict[str, dict[str, dict[str, Any]]]  # role -> kind -> HF name -> tensor
StateCheck = Callable[[Path, Any, dict], "str | None"]  # (folder, state, manifest) -> why it is malformed
log = get_logger("checkpoint")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


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


def _merged_index(indexes) -> dict[str, dict[str, dict[str, str]]]:
    """Every rank's role -> kind -> HF name -> file index, as one."""
    merged: dict[str, dict[str, dict[str, str]]] = {}
    for index in indexes:
        for role, kinds in index.items():
            for kind, files in kinds.items():
                merged.setdefault(role, {}).setdefault(kind, {}).update(files)
    return merged


def _insert(state: dict[str, Any], path: tuple[str, ...], subtree: Any) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = subtree


def _check_meta(path: Path, manifest: dict, expected: dict[str, Any]) -> None:
    for key, want in expected.items():
        if manifest.get(key) != want:
            raise CheckpointError(f"checkpoint {path} has {key}={manifest.get(key)!r} but this run has "
                                  f"{want!r}; resume with the same setting or export to HF and re-import")


def _own_file(manifest: dict) -> str:
    """This rank's state file; a rank beyond the writing world's reads rank 0's (the world was resized)."""
    name = rank_file(_rank())
    return name if name in manifest["files"] else rank_file(0)


def _tensor_files(manifest: dict) -> list[str]:
    return sorted({file for kinds in manifest.get("tensors", {}).values() for files in kinds.values()
                   for file in files.values()})


def _kind_of_file(manifest: dict) -> dict[str, str]:
    return {file: kind for kinds in manifest.get("tensors", {}).values() for kind, files in kinds.items()
            for file in files.values()}


def _verify_tensor_files(path: Path, manifest: dict) -> None:
    """This rank's share of the tensor files (round robin): sha256 against the manifest, then every tensor's
    dtype and values (finite; second moments non-negative)."""
    kinds = _kind_of_file(manifest)
    for name in _tensor_files(manifest)[_rank()::_world()]:
        problem = file_problem(path / name, manifest["files"].get(name))
        try:
            problem = problem or tensor_file_problem(path / name, kinds[name])
        except CheckpointError as error:
            problem = str(error)
        if problem:
            raise CorruptCheckpointError(problem)


def tensor_folders(path: Path, manifest: dict, role: str) -> Callable[[str], HfFolder]:
    """`kind -> HfFolder` over a checkpoint's full tensors of `role` (kinds: model, exp_avg, exp_avg_sq,
    master; an fp32 run has no master: its weights are the masters)."""
    kinds = manifest.get("tensors", {}).get(role)
    if kinds is None:
        raise CheckpointError(f"checkpoint {path} holds no weights of the {role}")

    def folder_of(kind: str) -> HfFolder:
        files = kinds.get(kind) or (kinds["model"] if kind == "master" else None)
        if files is None:
            raise CheckpointError(f"checkpoint {path} holds no {kind} state of the {role}")
        return HfFolder.of_files(str(path), files)

    return folder_of


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


@dataclass
class _Pending:
    """A save whose files are being written; published by `CheckpointManager.commit`."""

    step: int
    tmp: Path
    final: Path
    meta: dict[str, Any]
    index: dict[str, dict[str, dict[str, str]]]  # role -> kind -> HF name -> file
    writer: Writer


class CheckpointManager:
    """Saves and restores per-rank state under `<run>/checkpoints/`. All ranks call every method."""

    def __init__(self, root: str | Path, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self._pending: _Pending | None = None

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None,
             replicated: list[Replicated] = (), tensors: RoleTensors | None = None, wait: bool = True) -> Path:
        """Collective: write this rank's `state` (each `replicated` subtree once per group) and the full
        `tensors` it keeps; published at once, or (`wait=False`) by the next `commit` while a thread writes."""
        self.commit()  # an earlier async save is published (or refused) before this one starts
        rank = _rank()
        check_root(self.root)
        final, tmp = self.root / f"step_{step}", self.root / f"step_{step}.tmp"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.is_symlink():
                tmp.unlink()
            shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted write
            tmp.mkdir()
        _barrier()
        local, shared = _split(state, list(replicated))
        jobs = [(name, encode_state(tree)) for name, tree in [(rank_file(rank), local), *shared]]
        index: dict[str, dict[str, dict[str, str]]] = {}
        for role, kinds in (tensors or {}).items():
            for kind, named in kinds.items():
                file = f"{role}_{kind}_r{rank}.safetensors"
                index.setdefault(role, {})[kind] = {name: file for name in named}
                if named:
                    jobs.append((file, named))
        writer = Writer(tmp, jobs)
        self._pending = _Pending(step, tmp, final, dict(meta or {}), index, writer)
        if wait:
            writer.run()
            self.commit()
        else:
            writer.start()
        return final

    def commit(self) -> Path | None:
        """Collective: wait until every rank has written the pending save, then publish it (rank 0: manifest,
        rename, `latest`, prune). A rank whose writer failed makes it a CheckpointError on every rank, and the
        previous checkpoint stays latest. Nothing pending: returns None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        entries, error = pending.writer.result()
        reports = all_gather_json([entries, error, pending.index])
        failed = [(rank, report[1]) for rank, report in enumerate(reports) if report[1]]
        if failed:
            rank, reason = failed[0]
            raise CheckpointError(f"checkpoint {pending.final} was not published: rank {rank} failed to write "
                                  f"it ({reason}); the previous checkpoint stays latest")
        written = [entry for report in reports for entry in report[0]]
        files = dict(written)
        assert len(files) == len(written), f"two ranks wrote one file: {sorted(name for name, _ in written)}"
        if _rank() == 0:
            self._publish(pending, files, _merged_index(report[2] for report in reports))
        _barrier()
        return pending.final

    def _publish(self, pending: _Pending, files: dict, tensors: dict) -> None:
        record = {"format": FORMAT, "step": pending.step, "world_size": _world(), "time": time.time(),
                  **pending.meta, "tensors": tensors, "files": files}
        write_durable(pending.tmp / MANIFEST, json.dumps(record, indent=2).encode())
        fsync_dir(pending.tmp)
        if pending.final.is_symlink():  # the link itself goes, never what it points at
            log.warning("checkpoint: replacing the symlink %s (to %s)", pending.final, os.readlink(pending.final))
            pending.final.unlink()
        elif pending.final.exists():
            shutil.rmtree(pending.final)
        os.replace(pending.tmp, pending.final)
        fsync_dir(self.root)
        latest_tmp = self.root / f"{LATEST}.tmp"
        latest_tmp.unlink(missing_ok=True)  # a planted symlink would be written through
        write_durable(latest_tmp, pending.final.name.encode())
        os.replace(latest_tmp, self.root / LATEST)
        self._prune()

    def _prune(self) -> None:
        complete = [p for p in step_folders(self.root) if is_complete(p)]
        for old in complete[:-self.keep_last]:
            shutil.rmtree(old)

    def resolve(self, resume: str) -> Path | None:
        """`auto` -> newest complete checkpoint or None; `none` -> None; else that folder (must be complete)."""
        if resume == "none":
            return None
        if resume == "auto":
            return find_latest(self.root)
        path = Path(resume)
        if path.is_symlink():
            raise CheckpointError(f"checkpoint.resume={resume!r} is a symlink (to {os.readlink(path)}); "
                                  "checkpoints are never read through one: name the real folder")
        if not STEP_DIR.match(path.name) or not (path / MANIFEST).is_file():
            raise CheckpointError(f"checkpoint.resume={resume!r} is not a complete checkpoint folder "
                                  f"(needs step_<N>/{MANIFEST} and every file it lists){old_format_note(path)}")
        return path

    def load(self, path: Path, expected_meta: dict[str, Any] | None = None, replicated: list[Replicated] = (),
             check: StateCheck | None = None) -> tuple[dict[str, Any], dict]:
        """Collective: this rank's state (with its `replicated` subtrees) and the manifest, after the ranks
        verified every file between them (sizes, sha256; tensor files round robin). Any world size may load:
        the full tensors are read through `tensor_folders`, a rank the writing world lacked reads rank 0's file.

        Manifest keys in `expected_meta` must match exactly (CheckpointError); a file that does not verify, or
        a state `check(path, state, manifest)` finds malformed, is a CorruptCheckpointError naming it, raised on
        every rank.
        """
        state, failure = None, None
        try:
            manifest = read_manifest(path)
            _check_meta(path, manifest, expected_meta or {})
            state = _read_verified(path / _own_file(manifest), manifest)
            for spec in replicated:
                _insert(state, spec.path, _read_verified(path / spec.file, manifest))
            _verify_tensor_files(path, manifest)
            problem = check(path, state, manifest) if check is not None else None
            if problem:
                raise CorruptCheckpointError(problem)
        except CheckpointError as error:
            failure = [isinstance(error, CorruptCheckpointError), str(error)]
        failure = agree(failure)
        if failure:
            raise (CorruptCheckpointError if failure[0] else CheckpointError)(failure[1])
        return state, manifest

    def load_for_resume(self, resume: str, expected_meta: dict[str, Any] | None = None,
                        replicated: list[Replicated] = (),
                        check: StateCheck | None = None) -> tuple[Path, dict[str, Any], dict] | None:
        """Collective: the checkpoint `resume` names, loaded and verified; `auto` takes the newest that verifies,
        logging each newer one it skips and why. None when there is nothing to resume."""
        if resume != "auto":
            path = self.resolve(resume)
            return None if path is None else (path, *self.load(path, expected_meta, replicated, check))
        for name in self._candidates():
            path = self.root / name
            try:
                return (path, *self.load(path, expected_meta, replicated, check))
            except CorruptCheckpointError as error:
                log.warning("checkpoint: skipping %s: %s", name, error)
        return None

    def _candidates(self) -> list[str]:
        """Published step folders, newest first, as rank 0 sees them (so every rank tries the same ones)."""
        problem = None
        try:
            check_root(self.root)
            names = [p.name for p in reversed(step_folders(self.root))]
        except CheckpointError as error:
            problem, names = str(error), []
        problem, names = all_gather_json([problem, names])[0]
        if problem:
            raise CheckpointError(problem)
        return names

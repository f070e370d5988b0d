"""Writing a checkpoint's files durably, inline (sync save) or on a writer thread (async save).

A job is a file name and its payload: the bytes of a state file, or a dict of host tensors for a safetensors
file. Everything a job holds is a snapshot taken when the save began, so training may go on while it is
written. A writer never raises: its error is reported to the commit, which every rank takes part in.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlhf.checkpoint.verify import disk_entry, file_entry


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_tensor_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`tensors` as a safetensors file at `path`, fsynced; its manifest entry (of the bytes on disk)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return disk_entry(path)


class Writer:
    """Writes `jobs` into `folder`; `start()` on a thread (async) or `run()` inline; `result()` waits for it."""

    def __init__(self, folder: Path, jobs: list[tuple[str, bytes | dict[str, torch.Tensor]]]) -> None:
        self.folder, self.jobs = folder, jobs
        self.entries: list[list] = []
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        try:
            for name, payload in self.jobs:
                path = self.folder / name
                if isinstance(payload, bytes):
                    write_durable(path, payload)
                    self.entries.append([name, file_entry(payload)])
                else:
                    self.entries.append([name, write_tensor_file(path, payload)])
        except Exception as error:  # reported to every rank by the commit, which then publishes nothing
            self.error = f"{type(error).__name__}: {error}"
        self.jobs = []  # the host copies are no longer needed

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def result(self) -> tuple[list[list], str | None]:
        """(file name, manifest entry) pairs written, and the error that stopped the writer (or None)."""
        if self._thread is not None:
            self._thread.join()
        return self.entries, self.error

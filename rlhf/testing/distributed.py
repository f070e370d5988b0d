"""Run a function on N real gloo processes with a hard deadline.

A hang fails with every rank's Python stack instead of stalling the caller; an exception on any rank
fails with that rank's traceback. The deadline counts from the moment every rank has started (imports and
process-group init done), so a loaded machine that is slow to spawn cannot fail a test. Used by every
multi-rank test and by the benchmarks.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

STACK_SIGNAL = signal.SIGUSR1
STARTUP_TIMEOUT_S = 900.0  # spawn + imports + rendezvous; only a broken start ever reaches it


class FakeGroup:
    """A process group's size and rank without a world, for code that only reads those (cp shard layouts)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class DistributedTestError(RuntimeError):
    """A rank raised, died, or the world missed its deadline; the message carries the evidence."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, world_size: int, port: int, backend: str, stack_dir: str, results: Any,
           fn: Callable, args: tuple, kwargs: dict, env: dict) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    stack_file = open(os.path.join(stack_dir, f"rank{rank}.stacks"), "w")
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend != "none":
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        results.put((rank, "started", None, time.time()))
        # Plain pickle copies tensor data into the message; the queue's own reducer would share it through
        # a socket that vanishes when this process exits.
        value = pickle.dumps(fn(*args, **kwargs))
        results.put((rank, "ok", value, time.time()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc(), time.time()))
    finally:
        if backend != "none" and dist.is_initialized():
            dist.destroy_process_group()


def _collect_stacks(procs: list, stack_dir: str) -> str:
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, STACK_SIGNAL)
    for proc in procs:
        proc.join(timeout=1.0)  # give faulthandler a moment to write; the process stays blocked
    parts = []
    for rank in range(len(procs)):
        path = os.path.join(stack_dir, f"rank{rank}.stacks")
        if not os.path.exists(path):
            parts.append(f"--- rank {rank} stacks ---\n(no stacks: the rank had not started yet)")
            continue
        with open(path) as f:
            text = f.read().strip()
        parts.append(f"--- rank {rank} stacks ---\n{text or '(exited, no stack)'}")
    return "\n".join(parts)


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 120.0, env: dict | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` spawned ranks; return the per-rank results in rank order.

    `fn` must be importable (module level). The process group is initialised before `fn` runs
    (`backend="none"` skips it). `timeout_s` starts once every rank has started. Raises
    `DistributedTestError` on any rank error, death or timeout.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rlhf-dist-") as stack_dir:
        procs = [ctx.Process(target=_child, daemon=True,
                             args=(rank, world_size, port, backend, stack_dir, results, fn, args, kwargs,
                                   dict(env or {})))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        try:
            return _gather(procs, results, world_size, timeout_s, stack_dir)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=5)


def _gather(procs: list, results: Any, world_size: int, timeout_s: float, stack_dir: str) -> list[Any]:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    started: set[int] = set()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failed_at: dict[int, float] = {}
    while len(values) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _raise_timeout(procs, stack_dir, world_size, timeout_s, started, values, errors, failed_at)
        try:
            rank, status, payload, when = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode not in (0, None) and r not in values and r not in errors]
            for rank in dead:
                errors[rank] = f"process died with exit code {procs[rank].exitcode}"
                failed_at[rank] = time.time()
            if errors:
                # Survivors are probably blocked in a collective with the failed rank: short grace, then stop.
                deadline = min(deadline, time.monotonic() + 10.0)
            continue
        if status == "started":
            started.add(rank)
            if len(started) == world_size and not errors:
                deadline = time.monotonic() + timeout_s
        elif status == "ok":
            values[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
            failed_at[rank] = when
            deadline = min(deadline, time.monotonic() + 10.0)
    if errors:
        first = min(failed_at, key=failed_at.get)  # the first to fail is the likeliest cause
        others = sorted(set(errors) - {first})
        raise DistributedTestError(f"rank {first} failed (also failed: {others}):\n{errors[first]}")
    return [values[rank] for rank in range(world_size)]


def _raise_timeout(procs: list, stack_dir: str, world_size: int, timeout_s: float, started: set[int],
                   values: dict, errors: dict, failed_at: dict) -> None:
    missing = sorted(set(range(world_size)) - set(values) - set(errors))
    stacks = _collect_stacks(procs, stack_dir)
    if errors:
        first = min(failed_at, key=failed_at.get)  # the first to fail is the likeliest cause
        raise DistributedTestError(
            f"rank {first} failed; ranks {missing} then stayed blocked:\n{errors[first]}\n{stacks}")
    unstarted = sorted(set(range(world_size)) - started)
    if unstarted:
        raise DistributedTestError(
            f"ranks {unstarted} did not start within {STARTUP_TIMEOUT_S:.0f}s (spawn, imports or process-group "
            f"init)\n{stacks}")
    raise DistributedTestError(f"ranks {missing} did not finish within {timeout_s:.0f}s of starting (hang?)\n"
                               f"{stacks}")

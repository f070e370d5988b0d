"""Turn a hang into a loud, all-ranks, non-zero exit with every thread's stack in each rank's log.

A daemon thread watches the current phase (`with watchdog.phase("update_actor"):`) and the collective in
flight (`rlhf.parallel.inflight`). Past a deadline it writes the phase, the in-flight collective, the peers'
last heartbeats and a faulthandler dump of all threads to the rank log, then exits with `EXIT_CODE`.

How every rank ends up non-zero: with a `store`, the first rank to expire posts an abort key; every other
rank's watchdog sees it within `poll_s`, dumps its own stacks, acknowledges and exits (each waits, bounded,
for all acks first, so the store host outlives the dumps). Without a store, gloo peers blocked on the dead
rank fail with "Connection closed by peer", and ranks not blocked reach their own deadline.
Backstop: if the watchdog thread itself cannot run (a C call holding the GIL), faulthandler's C-level timer
dumps the stacks to the same log and exits 1 (faulthandler's fixed code), `backstop_grace_s` after the deadline.

Who died: with a store, each poll checks the pids of same-host peers, and a block left by an exception checks
every peer (`rlhf.parallel.peers`); the first finding is logged once, e.g. "peer failure: rank 1 (pid 7 on h) has
exited". SIGTERM (torchrun ending the survivors of a dead rank) wakes the watchdog thread through Python's
wakeup fd even while the main thread is blocked in a collective: it logs that, and the dead peer, and exits 143.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from rlhf.parallel import inflight, peers
from rlhf.errors import ConfigError
from rlhf.platform import set_async_error_handling_env
from rlhf.platform.compat import torch as torch_compat

EXIT_CODE = 124
TERMINATED_EXIT_CODE = 128 + signal.SIGTERM
_PREFIX = peers.PREFIX


class Watchdog:
    """Deadlines for phases (`timeout_s`); a single collective is bounded by the process-group timeout
    (`dist.timeout_s`), and the report names the one in flight."""

    def __init__(self, *, timeout_s: float, log_file: str | os.PathLike | None,
                 group: dist.ProcessGroup | None = None, store: dist.Store | None = None,
                 poll_s: float = 1.0, ack_wait_s: float = 10.0, backstop_grace_s: float = 60.0) -> None:
        for label, value in (("comm.step_timeout_s", timeout_s), ("poll_s", poll_s),
                             ("backstop_grace_s", backstop_grace_s)):
            if not value > 0:
                raise ConfigError(f"watchdog {label}={value!r} must be a positive number of seconds")
        self.timeout_s = timeout_s
        self.log_file = os.fspath(log_file) if log_file is not None else None  # None: the process stderr (fd 2)
        self.group = group
        self.store = store
        self.poll_s = poll_s
        self.ack_wait_s = ack_wait_s
        self.backstop_grace_s = backstop_grace_s
        self.rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        self.world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        self._lock = threading.Lock()
        self._phase: tuple[str, float, float] | None = None  # name, started (monotonic), deadline in s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop_log = None
        self._peer_failure_logged = threading.Event()
        self._same_host: dict[int, dict | None] = {}
        set_async_error_handling_env()

    def __enter__(self) -> Watchdog:
        self.start()
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> None:
        if exc_type is not None:
            self.report_failed_peers()
        self.stop()

    def start(self) -> None:
        self._stop.clear()
        # held open for faulthandler's timer
        self._backstop_log = open(self.log_file, "a") if self.log_file else sys.__stderr__  # noqa: SIM115
        if self.store is not None:
            _store_call(peers.publish_identity, self.store, self.rank)
            self._publish(self._status())  # a rank's heartbeat exists from the moment its watchdog runs
            self._same_host = dict.fromkeys(peers.same_host_ranks(self.rank, self.world_size))
        self._wakeup = _Wakeup()
        self._thread = threading.Thread(target=self._run, name="rlhf-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.store is not None and self._thread is not None:
            _store_call(peers.mark_finished, self.store, self.rank)
        if self._thread is not None:
            self._wakeup.wake()
            self._thread.join()
            self._thread = None
            self._wakeup.close()
        if self._backstop_log is not None:
            faulthandler.cancel_dump_traceback_later()
            if self._backstop_log is not sys.__stderr__:
                self._backstop_log.close()
            self._backstop_log = None

    def report_failed_peers(self) -> None:
        """Log (once) which peers are gone or silent; nothing when none can be named (or without a store)."""
        if self.store is None or self._peer_failure_logged.is_set():
            return
        found = peers.failed_peers(self.store, self.rank, self.world_size, stale_s=self._stale_s())
        if found:
            self._log_peer_failure("; ".join(found))

    def _stale_s(self) -> float:
        return max(10 * self.poll_s, 10.0)

    def _watch_same_host_peers(self) -> None:
        """A same-host peer whose pid vanished has died: say so now, before a launcher ends this rank too."""
        if self._peer_failure_logged.is_set():
            return
        for rank, who in self._same_host.items():
            if who is None:
                who = self._same_host[rank] = _store_call(peers.identity, self.store, rank)
            if who is not None and peers.pid_gone(who["pid"]) and not _store_call(peers.finished, self.store,
                                                                                        rank):
                self._log_peer_failure(peers.describe_exit(rank, who))
                return

    def _terminated(self) -> None:
        """SIGTERM: say so (and which same-host peer is gone) in the rank log, then exit as SIGTERM would."""
        try:
            self._append(f"[rlhf watchdog] rank {self.rank} pid {os.getpid()}: terminated by SIGTERM "
                         f"(phase {self._status()['phase']})\n")
            self._watch_same_host_peers()
        finally:
            os._exit(TERMINATED_EXIT_CODE)

    def _log_peer_failure(self, text: str) -> None:
        if self._peer_failure_logged.is_set():
            return
        self._peer_failure_logged.set()
        self._append(f"[rlhf watchdog] rank {self.rank}: peer failure: {text}\n")

    def _append(self, text: str) -> None:
        try:
            log = open(self.log_file, "a") if self.log_file else sys.__stderr__  # noqa: SIM115 - closed below
        except OSError:
            log = sys.__stderr__
        log.write(text)
        log.flush()
        if log is not sys.__stderr__:
            log.close()

    @contextmanager
    def phase(self, name: str, timeout_s: float | None = None) -> Iterator[None]:
        """Run the block under a deadline (`timeout_s`, default the watchdog's); an enclosing phase's deadline
        restarts when the block ends (finishing it was progress)."""
        with self._lock:
            outer = self._phase
            self._set_phase((name, time.monotonic(), timeout_s or self.timeout_s))
        try:
            yield
        finally:
            with self._lock:
                self._set_phase((outer[0], time.monotonic(), outer[2]) if outer else None)

    def _set_phase(self, phase: tuple[str, float, float] | None) -> None:
        """Switch phase (caller holds the lock) and re-arm the faulthandler backstop for its deadline."""
        self._phase = phase
        if self._backstop_log is None:
            return
        if phase is None:
            faulthandler.cancel_dump_traceback_later()
            return
        remaining_s = phase[2] - (time.monotonic() - phase[1])
        faulthandler.dump_traceback_later(max(remaining_s, 0.0) + self.backstop_grace_s, exit=True,
                                          file=self._backstop_log)

    def _run(self) -> None:
        while True:
            woken_by = self._wakeup.wait(self.poll_s)
            if self._stop.is_set():
                return
            if signal.SIGTERM in woken_by:
                self._terminated()
            status = self._status()
            self._publish(status)
            reason = self._expired() or self._peer_abort()
            if reason:
                self._fire(reason, status)
            self._watch_same_host_peers()

    def _status(self) -> dict:
        with self._lock:
            phase = self._phase
        current = inflight.current()
        return {"time": time.time(), "pid": os.getpid(),
                "phase": phase[0] if phase else None,
                "phase_s": round(time.monotonic() - phase[1], 3) if phase else None,
                "in_flight": current.description if current else None,
                "in_flight_s": round(current.age_s(), 3) if current else None}

    def _expired(self) -> str | None:
        with self._lock:
            phase = self._phase
        if phase is not None and time.monotonic() - phase[1] > phase[2]:
            return f"phase {phase[0]!r} exceeded its {phase[2]:g}s deadline"
        return None

    def _publish(self, status: dict) -> None:
        if self.store is not None:
            _store_call(self.store.set, f"{_PREFIX}/heartbeat/{self.rank}", json.dumps(status))

    def _peer_abort(self) -> str | None:
        key = f"{_PREFIX}/abort"
        if self.store is None or not _store_call(self.store.check, [key]):
            return None
        cause = _store_call(self.store.get, key)
        return f"aborting because {cause.decode() if cause else 'a peer aborted'}"

    def _fire(self, reason: str, status: dict) -> None:
        """Post the abort, write the evidence, let peers dump theirs, abort the group; always exit."""
        try:
            if self.store is not None:
                _store_call(self.store.set, f"{_PREFIX}/abort", f"rank {self.rank}: {reason}")
            self._write_report(reason, status)
            self._await_peers()
            _abort_group(self.group)
        finally:
            os._exit(EXIT_CODE)

    def _write_report(self, reason: str, status: dict) -> None:
        try:
            log = open(self.log_file, "a") if self.log_file else sys.__stderr__  # noqa: SIM115 - closed below
        except OSError:
            log = sys.__stderr__
        log.write(f"[rlhf watchdog] rank {self.rank} pid {os.getpid()}: {reason}\n"
                  f"[rlhf watchdog] {_describe(status)}\n")
        log.write(self._peer_report())
        log.flush()
        faulthandler.dump_traceback(file=log, all_threads=True)
        log.flush()
        if log is not sys.__stderr__:
            os.fsync(log.fileno())
            log.close()

    def _peer_report(self) -> str:
        if self.store is None:
            return "[rlhf watchdog] no store: peer heartbeats unknown\n"
        lines = []
        for rank, beat in read_heartbeats(self.store, self.world_size).items():
            if beat is None:
                lines.append(f"[rlhf watchdog]   rank {rank}: no heartbeat\n")
                continue
            age_s = time.time() - beat["time"]
            lines.append(f"[rlhf watchdog]   rank {rank}: {age_s:.1f}s ago, {_describe(beat)}\n")
        return "[rlhf watchdog] last heartbeats:\n" + "".join(lines)

    def _await_peers(self) -> None:
        """Ack our dump, then wait (bounded) for every rank's ack so the store host outlives the others' dumps."""
        if self.store is None:
            return
        _store_call(self.store.set, f"{_PREFIX}/ack/{self.rank}", "1")
        keys = [f"{_PREFIX}/ack/{rank}" for rank in range(self.world_size)]
        deadline = time.monotonic() + self.ack_wait_s
        while time.monotonic() < deadline and not _store_call(self.store.check, keys):
            time.sleep(min(0.1, self.poll_s))


def _store_call(method, *args):
    """A store operation that tolerates a dead store host (the watchdog must reach its exit)."""
    try:
        return method(*args)
    except (RuntimeError, dist.DistStoreError, OSError, peers.StoreUnreachable):
        return None


def read_heartbeats(store: dist.Store, world_size: int) -> dict[int, dict | None]:
    """Every rank's last published status (`time` is its wall clock then), None where there is none yet."""
    beats: dict[int, dict | None] = {}
    for rank in range(world_size):
        key = f"{_PREFIX}/heartbeat/{rank}"
        raw = _store_call(store.get, key) if _store_call(store.check, [key]) else None
        beats[rank] = json.loads(raw) if raw is not None else None
    return beats


def _describe(status: dict) -> str:
    phase = f"phase {status['phase']} ({status['phase_s']}s)" if status["phase"] else "no phase"
    collective = f"{status['in_flight']} ({status['in_flight_s']}s)" if status["in_flight"] else "none"
    return f"{phase}; in-flight collective: {collective}"


def _abort_group(group: dist.ProcessGroup | None) -> None:
    """Abort the process group (unblocks NCCL peers' kernels), but never let the abort itself hang the exit."""
    if not dist.is_initialized():
        return
    worker = threading.Thread(target=_try_abort, args=(group,), daemon=True)
    worker.start()
    worker.join(timeout=5.0)


def _try_abort(group: dist.ProcessGroup | None) -> None:
    try:
        torch_compat.abort_process_group(group)
    except Exception:  # noqa: BLE001 - best effort on the way out; os._exit follows regardless
        pass


class _Wakeup:
    """A pipe the watchdog thread sleeps on: stop() writes a byte; in the main thread, SIGTERM is routed to it
    too (Python's wakeup fd is written by the C-level handler, whatever the main thread is blocked in)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self._restore = None
        if threading.current_thread() is threading.main_thread():
            old_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
            old_handler = signal.signal(signal.SIGTERM, _leave_sigterm_to_the_watchdog)
            self._restore = (old_fd, old_handler)

    def wait(self, timeout_s: float) -> bytes:
        """The bytes written meanwhile (signal numbers, or 0 from `wake`), b"" after `timeout_s`."""
        readable, _, _ = select.select([self.read_fd], [], [], timeout_s)
        return os.read(self.read_fd, 64) if readable else b""

    def wake(self) -> None:
        try:
            os.write(self.write_fd, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the thread wakes anyway

    def close(self) -> None:
        if self._restore is not None:
            if threading.current_thread() is not threading.main_thread():
                return  # only the main thread may restore; keep the fds so no signal writes into a reused one
            signal.set_wakeup_fd(self._restore[0])
            signal.signal(signal.SIGTERM, self._restore[1])
        os.close(self.read_fd)
        os.close(self.write_fd)


def _leave_sigterm_to_the_watchdog(signum: int, frame: object) -> None:
    """The watchdog thread, woken through the wakeup fd, logs and exits; the main thread carries on meanwhile."""

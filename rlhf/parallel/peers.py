"""Which peer failed: every rank posts its host and pid to the store; survivors look for peers that are gone.

A peer on this host is dead when its pid no longer exists; any peer is suspect when its watchdog heartbeat is
stale; the store itself unreachable means its host (rank 0) is gone. A rank whose watched work ended normally
marks itself finished, so its exit is never reported. Store reads are few: same-host peers' identities once,
every peer only when this rank is already failing.
"""

from __future__ import annotations

import json
import os
import socket
import time

import torch.distributed as dist

PREFIX = "rlhf/watchdog"


class StoreUnreachable(Exception):
    """The store did not answer (its host, rank 0, has most likely exited)."""


def _call(method, *args):
    try:
        return method(*args)
    except (RuntimeError, dist.DistStoreError, OSError) as error:
        raise StoreUnreachable(str(error).splitlines()[0] if str(error) else type(error).__name__) from None


def publish_identity(store: dist.Store, rank: int) -> None:
    """Post this rank's host and pid; a restarted watchdog clears its earlier `finished` mark."""
    _call(store.set, f"{PREFIX}/who/{rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    _call(store.delete_key, f"{PREFIX}/done/{rank}")


def mark_finished(store: dist.Store, rank: int) -> None:
    """This rank's watched work ended normally: its exit is no failure."""
    _call(store.set, f"{PREFIX}/done/{rank}", "1")


def finished(store: dist.Store, rank: int) -> bool:
    return bool(_call(store.check, [f"{PREFIX}/done/{rank}"]))


def identity(store: dist.Store, rank: int) -> dict | None:
    key = f"{PREFIX}/who/{rank}"
    return json.loads(_call(store.get, key)) if _call(store.check, [key]) else None


def same_host_ranks(rank: int, world_size: int) -> list[int]:
    """The other ranks a launcher (torchrun, srun block distribution) puts on this host: a contiguous block."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    first = rank - local_rank
    return [r for r in range(max(0, first), min(world_size, first + local_size)) if r != rank]


def pid_gone(pid: int) -> bool:
    """No such process, or only its zombie (exited, not yet reaped by the launcher)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def describe_exit(rank: int, who: dict) -> str:
    return f"rank {rank} (pid {who['pid']} on {who['host']}) has exited"


def failed_peers(store: dist.Store, rank: int, world_size: int, stale_s: float) -> list[str]:
    """One phrase per peer that is gone (same host) or whose heartbeat is older than `stale_s`."""
    try:
        found = []
        for peer in range(world_size):
            if peer == rank or finished(store, peer):
                continue
            who = identity(store, peer)
            if who is not None and who["host"] == socket.gethostname() and pid_gone(who["pid"]):
                found.append(describe_exit(peer, who))
                continue
            key = f"{PREFIX}/heartbeat/{peer}"
            beat = json.loads(_call(store.get, key)) if _call(store.check, [key]) else None
            if beat is not None and time.time() - beat["time"] > stale_s:
                found.append(f"rank {peer} sent no heartbeat for {time.time() - beat['time']:.0f}s "
                             f"(last: phase {beat['phase']})")
        return found
    except StoreUnreachable as error:
        return [f"the store on rank 0 is unreachable ({error}): rank 0 has most likely exited"]

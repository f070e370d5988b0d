"""Start and stop the SPMD world: from torchrun's env, Slurm's env (`srun python -m rlhf ...`), or one process.

`distributed(...)` is a context manager: it initialises the default process group, binds the device, seeds
every RNG, and on exit (also on exceptions) destroys the groups so no rank is left holding sockets.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.errors import ConfigError, ProcessGroupError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the world, and how to reach rank 0."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "single"


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise ConfigError(f"cannot read a host from the Slurm node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int_env(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"environment variable {key}={env[key]!r} must be an integer") from None


def detect_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """torchrun (RANK/WORLD_SIZE set) wins over Slurm (SLURM_PROCID set); otherwise a single process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(rank=_int_env(env, "RANK"), world_size=_int_env(env, "WORLD_SIZE"),
                       local_rank=_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                       local_world_size=(_int_env(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env
                                         else _int_env(env, "WORLD_SIZE")),
                       master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT,
                       launcher="torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        job_id = env.get("SLURM_JOB_ID", "0")
        # Same port on every rank of a job, different across jobs sharing a node.
        port = _int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else 20000 + zlib.crc32(job_id.encode()) % 20000
        tasks_per_node = env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1"))
        return DistEnv(rank=_int_env(env, "SLURM_PROCID"), world_size=_int_env(env, "SLURM_NTASKS"),
                       local_rank=_int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
                       local_world_size=int(re.match(r"\d+", tasks_per_node).group(0)),
                       master_addr=env.get("MASTER_ADDR") or first_host(nodelist), master_port=port,
                       launcher="slurm")
    return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                   master_port=_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else _free_port(),
                   launcher="single")


def _free_port() -> int:
    """A free local port for a single-process world (two such runs on one machine must not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def seed_host(seed: int) -> None:
    """Seed python's and numpy's global RNGs with `seed` (user reward functions may draw from them)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (and the accelerator) with `seed`."""
    seed_host(seed)
    platform.manual_seed_all(seed)


@dataclass(frozen=True)
class Runtime:
    """The initialised world as seen by this rank."""

    env: DistEnv
    backend: str
    device: torch.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_rank0(self) -> bool:
        return self.env.rank == 0


def _init_process_group(env: DistEnv, backend: str, timeout_s: float) -> None:
    """The default group; a rendezvous that fails (a rank never started, rank 0's address unreachable) is one
    line naming the address, the world size and the fixes, not torch's store traceback."""
    address = f"tcp://{env.master_addr}:{env.master_port}"
    try:
        dist.init_process_group(backend=backend, init_method=address, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    except dist.DistError as error:
        raise ProcessGroupError(
            f"process group init failed for rank {env.rank} of {env.world_size} at {address} after up to "
            f"{timeout_s:g} s ({str(error).splitlines()[0]}); start all {env.world_size} ranks (torchrun "
            "--nproc_per_node / srun tasks), make MASTER_ADDR:MASTER_PORT reachable from every node, or raise "
            "dist.timeout_s") from None


@contextlib.contextmanager
def distributed(backend: str = "auto", timeout_s: float = 600.0, seed: int = 1234,
                env: DistEnv | None = None) -> Iterator[Runtime]:
    """Initialise the default process group for this process; always tear it down on exit."""
    env = env or detect_env()
    backend = platform.resolve_backend(backend)
    platform.prepare_backend_env(backend)
    device = platform.device_for_local_rank(env.local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        _init_process_group(env, backend, timeout_s)
    seed_everything(seed)
    try:
        yield Runtime(env=env, backend=backend, device=device)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()

"""The shm transport leaves nothing in /dev/shm when a rank is SIGKILLed during set-up: the survivor unlinks the
plan's segments; when no rank survives, `remove_dead_segments` (run by the next set-up and `rlhf doctor
--clean-shm`) removes those whose owner pid is gone."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import torch

from rlhf.reshard.planner import Transfer
from rlhf.reshard.schedule import Bucket, Schedule
from rlhf.reshard.shm import SEGMENT_PREFIX, SHM_DIR, list_segments, remove_dead_segments
from rlhf.testing.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2


def _schedule() -> Schedule:
    def bucket(src, dst):
        transfer = Transfer(param="w", src_rank=src, dst_rank=dst, src_name="w", dst_name="w", dim=0, src_start=0,
                            dst_start=0, length=1024, shape=(1024,))
        return Bucket(src_rank=src, dst_rank=dst, transfers=(transfer,))

    return Schedule(rounds=((bucket(0, 1), bucket(1, 0)),), local=())


def _rank_main(rank: int, port: int, killed: tuple[int, ...], errors) -> None:
    """Set up the transport; ranks in `killed` SIGKILL themselves right after creating their segment."""
    import torch.distributed as dist

    from rlhf.reshard import shm

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    create = shm.SharedMemoryTransport._map

    def create_then_die(self, path, bucket):
        segment = create(self, path, bucket)
        if rank in killed:
            os.kill(os.getpid(), signal.SIGKILL)
        return segment

    shm.SharedMemoryTransport._map = create_then_die
    try:
        shm.SharedMemoryTransport(_schedule(), dtype=torch.float32)
    except RuntimeError as error:
        errors.put((rank, str(error)))


def _owned_by(pids: list[int]) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if any(f"-p{pid}-" in name for pid in pids)
                  and name.startswith(SEGMENT_PREFIX))


def _world(killed: tuple[int, ...]) -> tuple[list, list[int], dict]:
    ctx = mp.get_context("spawn")
    errors, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, killed, errors), daemon=True)
             for rank in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    reported = {}
    while not errors.empty():
        rank, message = errors.get()
        reported[rank] = message
    return procs, [proc.pid for proc in procs], reported


def test_a_kill_during_set_up_leaves_no_segment_behind():
    procs, pids, reported = _world(killed=(1,))
    assert [proc.exitcode for proc in procs] == [0, -signal.SIGKILL]
    assert list(reported) == [0], reported  # the survivor saw its peer die in the set-up barrier...
    assert _owned_by(pids) == []  # ...and unlinked both ranks' segments of the plan

    procs, pids, _ = _world(killed=(0, 1))  # nobody survives (torchrun ends the other ranks too)
    assert [proc.exitcode for proc in procs] == [-signal.SIGKILL] * 2
    left = _owned_by(pids)
    assert len(left) == 2 and all(f"-p{pid}-" in " ".join(left) for pid in pids), left
    assert {s.owner_alive for s in list_segments() if os.path.basename(s.path) in left} == {False}
    removed = remove_dead_segments()
    assert sorted(os.path.basename(s.path) for s in removed if os.path.basename(s.path) in left) == left
    assert _owned_by(pids) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_segments_of_dead_owners_are_removed(tmp_path):
    job = f"test{uuid.uuid4().hex[:8]}"
    dead = tmp_path / f"{SEGMENT_PREFIX}{job}-p{_dead_pid()}-abc-0-0-1"
    alive = tmp_path / f"{SEGMENT_PREFIX}{job}-p{os.getpid()}-abc-0-1-0"
    other = tmp_path / "not-rlhf-p1-x"
    for path in (dead, alive, other):
        path.write_bytes(b"\0" * 4096)
    found = {Path(s.path).name: (s.owner_alive, s.job, s.size_bytes) for s in list_segments(str(tmp_path))}
    assert found == {dead.name: (False, job, 4096), alive.name: (True, job, 4096)}
    assert [Path(s.path) for s in remove_dead_segments(str(tmp_path))] == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])


def test_doctor_clean_shm_removes_a_dead_jobs_segment():
    path = Path(SHM_DIR) / f"{SEGMENT_PREFIX}test{uuid.uuid4().hex[:8]}-p{_dead_pid()}-abc-0-0-1"
    path.write_bytes(b"\0" * 2**20)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    try:
        out = subprocess.run([sys.executable, "-m", "rlhf", "doctor", "--clean-shm"], env=env, capture_output=True,
                             text=True, timeout=300)
    finally:
        existed = path.exists()
        path.unlink(missing_ok=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"removed {path} (1.0 MB, job {path.name.split('-')[2]}, owner pid " in out.stdout, out.stdout
    assert not existed

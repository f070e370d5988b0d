"""Who died: a survivor's rank log names the SIGKILLed peer once (after a collective error, from a poll, or when
the launcher SIGTERMs it while it is blocked); a peer that finished normally is never named."""

import multiprocessing as mp
import os
import signal
import socket
from datetime import timedelta

import torch

from rlhf.parallel import peers
from rlhf.parallel.watchdog import TERMINATED_EXIT_CODE, Watchdog
from rlhf.testing.distributed import free_port


def _world_rank(rank: int, world_size: int, port: int, log_dir: str, scenario: str) -> None:
    import torch.distributed as dist

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    log_file = os.path.join(log_dir, f"rank{rank}.log")
    # poll_s=1000: the watchdog thread never polls, so each path below is exercised on purpose
    watchdog = Watchdog(timeout_s=600, log_file=log_file, store=store, poll_s=1000.0)
    if scenario == "error":  # rank 1 dies while rank 0 waits for it in a collective
        try:
            with watchdog:
                dist.barrier()  # both ranks have started their watchdogs
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.barrier()
        except RuntimeError:
            pass
        return
    if scenario == "sigterm":  # rank 2 blocks in a collective until the launcher's SIGTERM
        try:
            with watchdog:
                dist.barrier()
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.recv(torch.zeros(1), src=2 - rank)  # 0 and 2 wait for each other: never sent
        except RuntimeError:
            pass  # rank 0 (the store host): rank 2 went away
        return
    with watchdog:  # "poll": rank 1 is killed, rank 2 finishes normally, rank 0 checks on both
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        watchdog.start()
        pids = [peers.identity(store, r)["pid"] for r in (1, 2)]
        while not all(peers.pid_gone(pid) for pid in pids):  # bounded: both exit right after the barrier
            pass
        watchdog._watch_same_host_peers()
        watchdog._watch_same_host_peers()
        watchdog.report_failed_peers()
        watchdog.stop()


def _run(tmp_path, world_size: int, scenario: str) -> tuple[list[int], list[int], list[str]]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_world_rank, args=(rank, world_size, port, str(tmp_path), scenario), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    if scenario == "sigterm":  # what torchrun does once a rank died (here to rank 2 only: rank 0 keeps the store)
        procs[1].join(timeout=120)
        os.kill(procs[2].pid, signal.SIGTERM)
    for proc in procs:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in range(world_size)]
    return [p.exitcode for p in procs], [p.pid for p in procs], logs


def _failure_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "peer failure" in line]


def test_survivor_names_the_dead_peer_once_after_a_collective_error(tmp_path):
    codes, pids, logs = _run(tmp_path, 2, "error")
    assert codes == [0, -signal.SIGKILL]
    assert _failure_lines(logs[0]) == [f"[rlhf watchdog] rank 0: peer failure: rank 1 (pid {pids[1]} on "
                                       f"{socket.gethostname()}) has exited"]


def test_a_finished_peer_is_not_a_failure_a_killed_one_is(tmp_path):
    codes, pids, logs = _run(tmp_path, 3, "poll")
    assert codes == [0, -signal.SIGKILL, 0]
    assert _failure_lines(logs[0]) == [f"[rlhf watchdog] rank 0: peer failure: rank 1 (pid {pids[1]} on "
                                       f"{socket.gethostname()}) has exited"]
    assert _failure_lines(logs[2]) == []


def test_a_sigtermed_survivor_blocked_in_a_collective_logs_the_dead_peer_and_exits_143(tmp_path):
    codes, pids, logs = _run(tmp_path, 3, "sigterm")
    assert codes == [0, -signal.SIGKILL, TERMINATED_EXIT_CODE]
    host = socket.gethostname()
    assert f"[rlhf watchdog] rank 2 pid {pids[2]}: terminated by SIGTERM (phase None)\n" in logs[2]
    assert _failure_lines(logs[2]) == [f"[rlhf watchdog] rank 2: peer failure: rank 1 (pid {pids[1]} on {host}) "
                                       "has exited"]
    # rank 0's recv fails as rank 2's connection closes: rank 2's process may or may not be gone by the check
    rank1 = f"[rlhf watchdog] rank 0: peer failure: rank 1 (pid {pids[1]} on {host}) has exited"
    assert _failure_lines(logs[0]) in ([rank1], [f"{rank1}; rank 2 (pid {pids[2]} on {host}) has exited"])

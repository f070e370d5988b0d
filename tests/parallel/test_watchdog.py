"""An induced hang (one rank sleeps inside a step) ends with every rank exiting non-zero, stacks in each log."""

import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest
import torch

from rlhf.parallel.collectives import all_reduce
from rlhf.parallel.watchdog import EXIT_CODE, Watchdog
from rlhf.errors import ConfigError
from rlhf.testing.distributed import free_port

WORLD_SIZE = 3
STUCK_RANK = 1


def _stuck_in_reward_fn() -> None:
    time.sleep(3600)


def _rank_main(rank: int, port: int, log_dir: str, use_store: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    open(os.path.join(log_dir, f"rank{rank}.started"), "w").close()
    log_file = os.path.join(log_dir, f"rank{rank}.log")
    with Watchdog(timeout_s=4.0, log_file=log_file, store=store if use_store else None, poll_s=0.2) as watchdog:
        with watchdog.phase("score"):
            if rank == STUCK_RANK:
                _stuck_in_reward_fn()
            all_reduce({"reward/mean": torch.ones(1), "response_length/mean": torch.ones(1)}, name="metrics")
    time.sleep(3600)  # unreachable when the watchdog works: the parent would time out


def _wait_until_started(tmp_path, procs: list) -> None:
    """Block until every rank has initialised its process group, or one has ended (the caller reports it);
    imports can be slow on a loaded machine and must not count against the watchdog's deadline."""
    while not all((tmp_path / f"rank{rank}.started").exists() for rank in range(WORLD_SIZE)):
        if any(not proc.is_alive() for proc in procs):
            return
        procs[0].join(timeout=0.2)


def _run_world(tmp_path, use_store: bool) -> tuple[list, list[str]]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, str(tmp_path), use_store), daemon=True)
             for rank in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    _wait_until_started(tmp_path, procs)
    deadline = time.monotonic() + 90  # counts from the moment every rank has started
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert alive == [], f"ranks {alive} still running 90 s after start: the watchdog did not end them"
    logs = []
    for rank in range(WORLD_SIZE):
        path = tmp_path / f"rank{rank}.log"
        logs.append(path.read_text() if path.exists() else "")
    return [proc.exitcode for proc in procs], logs


def test_induced_hang_ends_all_ranks_non_zero_with_stacks_and_peer_heartbeats(tmp_path):
    exit_codes, logs = _run_world(tmp_path, use_store=True)
    assert exit_codes == [EXIT_CODE] * WORLD_SIZE
    for rank, log in enumerate(logs):
        assert f"[rlhf watchdog] rank {rank} pid" in log
        assert "most recent call first" in log and "_rank_main" in log, log  # a faulthandler stack dump
        assert "last heartbeats:" in log
        assert (f"rank {STUCK_RANK}: " in log and "phase score" in log), log
    assert "_stuck_in_reward_fn" in logs[STUCK_RANK]
    assert "in-flight collective: none" in logs[STUCK_RANK]
    for rank in set(range(WORLD_SIZE)) - {STUCK_RANK}:
        assert ("in-flight collective: metrics: all_reduce(op=sum, strategy=bucket, min_bucket_mb=1) 2 tensors"
                in logs[rank]), logs[rank]
        assert "in all_reduce" in logs[rank]


@pytest.mark.slow
def test_without_a_store_all_ranks_still_exit_non_zero(tmp_path):
    exit_codes, logs = _run_world(tmp_path, use_store=False)
    assert all(code not in (0, None) for code in exit_codes), exit_codes
    assert "_stuck_in_reward_fn" in logs[STUCK_RANK] and "no store" in logs[STUCK_RANK]


def test_bad_deadline_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"watchdog comm.step_timeout_s=0 must be a positive number"):
        Watchdog(timeout_s=0, log_file=tmp_path / "x.log")


def _gil_held_past_deadline(log_file: str) -> None:
    """The Python watchdog thread never gets to check (poll 1000 s); only the faulthandler backstop can act."""
    watchdog = Watchdog(timeout_s=0.5, log_file=log_file, poll_s=1000.0, backstop_grace_s=0.5)
    with watchdog, watchdog.phase("generate"):
        time.sleep(3600)


def test_backstop_dumps_and_exits_when_the_watchdog_thread_cannot_run(tmp_path):
    log_file = tmp_path / "rank0.log"
    proc = mp.get_context("spawn").Process(target=_gil_held_past_deadline, args=(str(log_file),), daemon=True)
    proc.start()
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 1
    text = log_file.read_text()
    assert text.startswith("Timeout (0:00:") and "_gil_held_past_deadline" in text, text

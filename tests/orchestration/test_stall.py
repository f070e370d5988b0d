"""A stall before the first step (rank 1's reward function never returns during the validation before training)
ends both directly launched `rlhf train` ranks with exit 124 and stacks in each rank log."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402

from rlhf.config.loader import save_config  # noqa: E402
from rlhf.parallel.watchdog import EXIT_CODE  # noqa: E402
from rlhf.testing.distributed import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STALL_FN = '''
import os
import time


def stall_in_validation(data_source, solution_str, ground_truth, extra_info):
    if os.environ["RANK"] == "1":
        time.sleep(3600)
    return 0.0
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=16, num_val=4)


def test_a_stall_in_validation_before_training_ends_every_rank_with_stacks(tiny, tmp_path):
    (tmp_path / "stall.py").write_text(STALL_FN)
    cfg = trainer_config(tiny, str(tmp_path / "runs"), ["comm.step_timeout_s=20", "reward.by_source={}",
                                                        f"reward.function={tmp_path / 'stall.py'}:stall_in_validation"])
    save_config(cfg, tmp_path / "c.yaml")
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "rlhf", "train", "--config", str(tmp_path / "c.yaml")],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + 400
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert [proc.returncode for proc in procs] == [EXIT_CODE, EXIT_CODE]
    logs = [(tmp_path / "runs" / "t" / f"rank{rank}.log").read_text() for rank in range(2)]
    for rank, log in enumerate(logs):  # both ranks' deadlines run out together: either may fire first
        reason = (rf"\[rlhf watchdog\] rank {rank} pid {procs[rank].pid}: (aborting because rank {1 - rank}: )?"
                  r"phase 'validation before training' exceeded its 20s deadline\n")
        assert re.search(reason, log), log[-3000:]
        assert "most recent call first" in log and "in validate" in log
    assert "in stall_in_validation" in logs[1]

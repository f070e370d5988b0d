"""World start-up from torchrun and Slurm environments, and teardown also after an exception."""

import os

import pytest
import torch.distributed as dist

from rlhf.parallel.runtime import DistEnv, detect_env, distributed, first_host
from rlhf.errors import ConfigError, ProcessGroupError
from rlhf.testing.distributed import free_port, run_distributed


@pytest.mark.parametrize("nodelist, host", [
    ("gpu07", "gpu07"), ("gpu[07-09,12]", "gpu07"), ("gpu[12,07-09],cpu1", "gpu12"),
    ("node-a[001-004]", "node-a001"), ("a1,b2", "a1")])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_torchrun_env():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h0",
           "MASTER_PORT": "1234", "SLURM_PROCID": "9", "SLURM_NTASKS": "16"}
    assert detect_env(env) == DistEnv(3, 8, 1, 2, "h0", 1234, "torchrun")


def test_slurm_env_without_torchrun():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "8",
           "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "4242"}
    got = detect_env(env)
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size, got.master_addr, got.launcher) == \
        (5, 16, 1, 8, "gpu03", "slurm")
    assert got.master_port == detect_env({**env, "SLURM_PROCID": "0"}).master_port, "same port on every rank"
    assert detect_env({**env, "MASTER_ADDR": "login1", "MASTER_PORT": "777"}).master_port == 777


def test_single_process_and_bad_env():
    assert detect_env({"MASTER_PORT": "29501"}) == DistEnv(0, 1, 0, 1, "127.0.0.1", 29501, "single")
    assert detect_env({}).launcher == "single" and detect_env({}).master_port > 0
    with pytest.raises(ConfigError, match=r"^environment variable RANK='x' must be an integer$"):
        detect_env({"RANK": "x", "WORLD_SIZE": "2"})


def _slurm_world(port, fail):
    rank = int(os.environ["RANK"])
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
           "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(port)}
    try:
        with distributed("gloo", timeout_s=30, seed=7, env=detect_env(env)) as runtime:
            import torch
            value = torch.tensor([runtime.rank + 1.0])
            dist.all_reduce(value)
            if fail:
                raise RuntimeError("user code failed")
    except RuntimeError as err:
        assert str(err) == "user code failed"
    return value.item(), dist.is_initialized(), runtime.env.launcher, torch.rand(1).item()


def test_slurm_world_initialises_and_tears_down_even_on_error():
    for fail in (False, True):
        results = run_distributed(_slurm_world, 2, free_port(), fail, backend="none", timeout_s=60)
        assert [r[:3] for r in results] == [(3.0, False, "slurm")] * 2
        assert results[0][3] == results[1][3], "seeded identically on every rank"


def test_a_missing_rank_is_one_line_naming_the_address():
    port = free_port()
    env = DistEnv(0, 2, 0, 2, "127.0.0.1", port, "torchrun")  # rank 1 never starts
    with pytest.raises(ProcessGroupError, match=(
            rf"^process group init failed for rank 0 of 2 at tcp://127\.0\.0\.1:{port} after up to 2 s \(.*"
            r"1/2 clients joined\.\); start all 2 ranks \(torchrun --nproc_per_node / srun tasks\), make "
            r"MASTER_ADDR:MASTER_PORT reachable from every node, or raise dist\.timeout_s$")):
        with distributed("gloo", timeout_s=2, env=env):
            pass
    assert not dist.is_initialized()


_TEARDOWN_PROBE = """
import os, sys
from rlhf.parallel.runtime import distributed
from transformers import AutoConfig
with distributed("gloo", timeout_s=60):
    AutoConfig.from_pretrained(sys.argv[1])  # imports torch._dynamo lazily, as `rlhf export` does
print(sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process's threads from /proc")
def test_teardown_leaves_no_gloo_thread_to_abort_at_exit(tmp_path):
    """After `distributed()` no gloo thread is left for interpreter exit to tear down (that aborted `rlhf export`
    now and then with SIGABRT), even when transformers imported torch's compiler while the group was live."""
    import subprocess
    import sys

    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    model = init_hf_model(InitModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                          intermediate_size=64, max_position_embeddings=64),
                          build_char_tokenizer(), tmp_path / "model")
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    result = subprocess.run([sys.executable, "-c", _TEARDOWN_PROBE, str(model)], capture_output=True, text=True,
                            env={**env, "PYTHONPATH": os.getcwd(), "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    threads = result.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads  # gloo_tcp_loop, pt_gloo_runloop: the group outlived its teardown

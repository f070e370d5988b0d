"""bf16 parameters through megatron's mixed-precision optimizers (plain and distributed): bitwise resume
after offload/reload. Slow: bf16 matmuls are emulated on this CPU."""

from __future__ import annotations

import pytest

from rlhf.testing.distributed import run_distributed
from tests.train.engine_world import engine_world_bf16
from tests.train.helpers import save_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    path = save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))
    return run_distributed(engine_world_bf16, 2, path, timeout_s=600)


@pytest.mark.parametrize("flag", [False, True])
def test_bf16_resume_is_bitwise_exact(world, flag):
    for rank_result in world:
        result = rank_result[f"distributed_optimizer={flag}"]
        assert result["changed"] and result["weights_equal"] and result["losses_equal"] and result["lr_equal"]

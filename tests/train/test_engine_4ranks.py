"""TrainEngine at the 4-rank layouts (TP2xDP2 with the distributed optimizer, PP2xDP2): parity with one rank
and transformers, and bitwise resume. Slow: a 4-rank world on this 2-core machine takes about a minute."""

from __future__ import annotations

import pytest

from rlhf.testing.distributed import run_distributed
from tests.train.engine_world import engine_world_4
from tests.train.helpers import save_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    path = save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))
    return run_distributed(engine_world_4, 4, path, timeout_s=600)


@pytest.mark.parametrize("layout", ["tp2dp2", "pp2dp2", "tp2dp2_distopt", "pp2dp2_distopt"])
def test_layouts_match_one_rank_and_transformers(world, layout):
    for rank_result in world:
        result = rank_result["layouts"]
        assert result[layout][0][0] == pytest.approx(result["hf_loss"], abs=1e-5)
        for (loss, norm), (ref_loss, ref_norm) in zip(result[layout], result["single"]):
            assert loss == pytest.approx(ref_loss, abs=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.parametrize("case", ["resume_tp2dp2_distopt", "resume_pp2dp2"])
def test_resume_is_bitwise_exact(world, case):
    for rank_result in world:
        result = rank_result[case]
        assert result["changed"] and result["weights_equal"] and result["losses_equal"] and result["lr_equal"]

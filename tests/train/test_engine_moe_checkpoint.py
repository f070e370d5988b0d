"""Layout-free checkpoints of a mixture-of-experts policy (tiny Qwen3-MoE, 4 experts, one dense layer) across
expert-parallel layouts, in one 2-rank gloo world: bitwise resume at EP2 (plain and distributed optimizer, whose
expert pieces follow the expert-data-parallel group), resume at another layout (EP2 -> one rank, EP2 -> DP2 at
EP1, DP2 -> EP2), and the tensors a re-save writes equal the ones it loaded, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlhf.testing.distributed import run_distributed
from tests.models.tiny import qwen3_moe_config, save_hf_model
from tests.train.engine_world import _batches, _engine, _loss_fn, _through_checkpoint, check_reshard, check_resume

def _tensors(folder_of, kinds: tuple[str, ...]) -> dict:
    """Every tensor of a checkpoint's role, per kind, read whole."""
    out = {}
    for kind in kinds:
        folder = folder_of(kind)
        out.update({(kind, name): folder.slice(name)[:] for name in folder.file_of})
    return out


def check_resave(path: str, pg: dict, source: str, target: str) -> dict:
    """Train 2 steps at `source` and save; load at `target` and save again: the same tensors, bitwise."""
    from rlhf.checkpoint.verify import state_kinds

    original = _engine(path, pg[source], use_distributed_optimizer=True, warmup_steps=1, total_steps=4)
    for i in range(2):
        original.train_step(_batches(pg[source], 2, seed=50 + i), _loss_fn(original))
    state, folder_of = _through_checkpoint(original, f"{path}-resave-{source}")
    loaded = _engine(path, pg[target], load=False, seed=99, use_distributed_optimizer=True, warmup_steps=1,
                     total_steps=4)
    loaded.load_state_dict(state, folder_of)
    again_state, again_folder_of = _through_checkpoint(loaded, f"{path}-resave-{source}-{target}")
    kinds = ("model", *state_kinds(loaded.module))
    first, second = _tensors(folder_of, kinds), _tensors(again_folder_of, kinds)
    experts = sorted({name for _, name in first if ".experts." in name})
    return {"same_names": sorted(first) == sorted(second), "experts": len(experts),
            "bitwise": all(torch.equal(first[key], second[key]) for key in first if key in second),
            "moments_nonzero": bool(first[("exp_avg", experts[0])].abs().sum() > 0)}


def moe_checkpoint_world(path: str) -> dict:
    from rlhf.parallel.groups import GroupCache, build_layout_groups
    from rlhf.parallel.layout import ParallelLayout

    torch.use_deterministic_algorithms(True)
    cache, rank = GroupCache(), dist.get_rank()
    pg = {"ep2": build_layout_groups(ParallelLayout(dp=2, ep=2), cache),
          "dp2": build_layout_groups(ParallelLayout(dp=2), cache)}
    pg["single"] = [build_layout_groups(ParallelLayout(first_rank=r), cache) for r in range(2)][rank]
    return {"resume_ep2": check_resume(path, pg, "ep2", False),
            "resume_ep2_distopt": check_resume(path, pg, "ep2", True),
            "reshard": {f"{a}->{b}": check_reshard(path, pg, a, b)
                        for a, b in (("ep2", "single"), ("ep2", "dp2"), ("dp2", "ep2"))},
            "resave": {f"{a}->{b}": check_resave(path, pg, a, b) for a, b in (("ep2", "dp2"), ("dp2", "ep2"))}}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    path = str(tmp_path_factory.mktemp("tiny_qwen3_moe"))
    save_hf_model(qwen3_moe_config(), path, seed=0)
    return run_distributed(moe_checkpoint_world, 2, path, timeout_s=600)


@pytest.mark.parametrize("case", ["resume_ep2", "resume_ep2_distopt"])
def test_resume_at_ep2_is_bitwise_exact(world, case):
    for rank_result in world:
        result = rank_result[case]
        assert result["changed"] and result["weights_equal"] and result["losses_equal"] and result["lr_equal"]
        assert result["steps"] == (4, 4)


@pytest.mark.parametrize("case", ["ep2->single", "ep2->dp2", "dp2->ep2"])
def test_resume_on_another_expert_layout_continues_the_run(world, case):
    for rank_result in world:
        result = rank_result["reshard"][case]
        (original, resumed) = result["losses"]
        assert result["changed"] and result["lr_equal"]
        assert resumed == pytest.approx(original, abs=1e-5)


@pytest.mark.parametrize("case", ["ep2->dp2", "dp2->ep2"])
def test_resave_on_another_expert_layout_is_bitwise(world, case):
    for rank_result in world:
        result = rank_result["resave"][case]
        assert result["experts"] == 3 * 4 * 3  # 3 routed layers x 4 experts x gate/up/down
        assert result["same_names"] and result["bitwise"] and result["moments_nonzero"]

"""Role meshes: planning rules (pure) and real groups on 4 gloo ranks for both placements."""

import pytest
import torch.distributed as dist

from rlhf.config import load_config
from rlhf.orchestration.schema import RlhfConfig
from rlhf.config.loader import from_dict
from rlhf.parallel.layout import ParallelLayout
from rlhf.parallel.meshes import MeshConfig, ModelDims, build_role_meshes, plan_meshes
from rlhf.errors import ConfigError
from rlhf.testing.distributed import run_distributed


def mesh(**data) -> MeshConfig:
    return from_dict(MeshConfig, {"roles": ["actor", "ref", "rollout"], **data}, "mesh")


def test_colocated_roles_span_the_world():
    cfg = mesh(roles=["actor", "critic", "ref", "rollout"], actor={"tp": 2, "pp": 2}, rollout={"tp": 4})
    layouts = plan_meshes(cfg, 8)
    assert layouts == {"actor": ParallelLayout(tp=2, pp=2, dp=2), "critic": ParallelLayout(dp=8),
                       "ref": ParallelLayout(dp=8), "rollout": ParallelLayout(tp=4, dp=2)}


def test_split_example_config_plans():
    cfg = load_config(RlhfConfig, "configs/recipes/split_8rank.yaml")
    layouts = plan_meshes(cfg.mesh, 8)
    assert layouts["actor"] == ParallelLayout(tp=2, dp=3, first_rank=0)
    assert layouts["critic"] == ParallelLayout(tp=2, dp=1, first_rank=6)
    assert layouts["reward"] == ParallelLayout(tp=1, dp=2, first_rank=6)
    assert layouts["rollout"] == ParallelLayout(tp=1, dp=6, first_rank=0)


@pytest.mark.parametrize("cfg, world, message", [
    (dict(actor={"tp": 3}), 8, r"^mesh\.actor: 8 ranks are not divisible by tp\*pp = 3\*1 = 3; choose"),
    (dict(rollout={"tp": 16}), 8, r"^mesh\.rollout: 8 ranks are not divisible by tp\*pp = 16\*1 = 16"),
    (dict(placement="split", actor={"ranks": [0, 4]}, ref={"ranks": [2, 6]}, rollout={"ranks": [0, 4]}), 8,
     r"^split ranges overlap: actor on \[0, 4\) and ref on \[2, 6\) share ranks 2\.\.3; ranges must be"),
    (dict(placement="split", actor={"ranks": [0, 4]}, ref={"ranks": [0, 4]}, rollout={"ranks": [0, 4]}), 8,
     r"^mesh\.placement=split leaves ranks \[4, 5, 6, 7\] without a role"),
    (dict(placement="split", actor={"ranks": [0, 4]}, rollout={"ranks": [0, 4]}), 8,
     r"^mesh\.placement=split needs mesh\.ref\.ranks=\[first, end\) for role 'ref'$"),
    (dict(placement="split", actor={"ranks": [0, 12]}, ref={"ranks": [0, 12]}, rollout={"ranks": [0, 12]}), 8,
     r"^mesh\.actor\.ranks=\[0, 12\] reaches past the world of 8 ranks$"),
    (dict(actor={"ranks": [0, 4]}), 8, r"^mesh\.actor\.ranks=\[0, 4\] is only valid with mesh\.placement=split$"),
])
def test_bad_layouts_are_config_errors(cfg, world, message):
    with pytest.raises(ConfigError, match=message):
        plan_meshes(mesh(**cfg), world)


def test_model_must_fit_the_layout():
    dims = ModelDims(num_layers=6, num_heads=12, num_kv_heads=2)
    with pytest.raises(ConfigError, match=r"^mesh\.actor\.tp=4 does not divide the model's 2 kv heads"):
        plan_meshes(mesh(actor={"tp": 4}), 8, dims)
    with pytest.raises(ConfigError, match=r"^mesh\.actor\.tp=8 does not divide the model's 12 attention heads"):
        plan_meshes(mesh(actor={"tp": 8}), 8, dims)
    with pytest.raises(ConfigError, match=r"^mesh\.actor\.pp=4 does not divide the model's 6 layers$"):
        plan_meshes(mesh(actor={"pp": 4}), 8, dims)
    with pytest.raises(ConfigError, match=r"^mesh\.critic\.tp=2 does not divide the model's 1 kv heads"):
        plan_meshes(mesh(roles=["actor", "critic", "rollout"], critic={"tp": 2}), 8, dims,
                     role_dims={"critic": ModelDims(6, 4, 1)})


def test_expert_parallel_roles():
    moe = ModelDims(num_layers=4, num_heads=4, num_kv_heads=2, num_experts=6)
    layouts = plan_meshes(mesh(actor={"ep": 2}, ref={"ep": 4, "pp": 2}), 8, moe._replace(num_experts=8))
    assert (layouts["actor"].dp, layouts["actor"].ep, layouts["ref"].ep, layouts["rollout"].ep) == (8, 2, 4, 1)
    with pytest.raises(ConfigError, match=r"^mesh\.actor\.ep=4 does not divide the model's 6 experts$"):
        plan_meshes(mesh(actor={"ep": 4}), 8, moe)
    with pytest.raises(ConfigError, match=r"^mesh\.actor\.ep=2 for a dense model; set ep=1$"):
        plan_meshes(mesh(actor={"ep": 2}), 8, ModelDims(4, 4, 2))
    with pytest.raises(ConfigError, match=r"^mesh\.actor: 8 ranks are not divisible by tp\*ep\*pp = 2\*8\*1 = 16"):
        plan_meshes(mesh(actor={"tp": 2, "ep": 8}), 8, moe._replace(num_experts=8))


@pytest.mark.parametrize("cfg, message", [
    (dict(roles=["actor", "judge", "rollout"]), r"^mesh\.roles has unknown role 'judge'; roles are actor, "),
    (dict(roles=["actor", "ref"]), r"must include 'actor' and 'rollout'$"),
    (dict(rollout={"pp": 2}), r"^mesh\.rollout\.pp=2: rollout engines run with pp=1"),
    (dict(rollout={"ep": 2}), r"^mesh\.rollout\.ep=2: rollout engines hold every expert \(ep=1\)"),
    (dict(rollout={"ep": 2}), r"^mesh\.rollout\.ep=2: rollout engines hold every expert \(ep=1\)"),
    (dict(actor={"ranks": [3, 1]}), r"ranks=\[3, 1\] must be \[first, end\)"),
])
def test_mesh_config_validation(cfg, message):
    with pytest.raises(ConfigError, match=message):
        mesh(**cfg)


def _build(cfg_dict):
    meshes = build_role_meshes(from_dict(MeshConfig, cfg_dict, "mesh"))
    out = {}
    for role, role_mesh in meshes.meshes.items():
        pgs = role_mesh.pgs
        out[role] = None if pgs is None else {
            name: dist.get_process_group_ranks(getattr(pgs, name)) for name in ("tp", "dp", "pp")}
    return out


SPLIT = dict(placement="split", roles=["actor", "critic", "ref", "rollout"],
             actor={"tp": 2, "ranks": [0, 2]}, ref={"ranks": [0, 2]}, rollout={"tp": 1, "ranks": [0, 2]},
             critic={"pp": 2, "ranks": [2, 4]})


def test_split_placement_groups_on_4_ranks():
    results = run_distributed(_build, 4, SPLIT, timeout_s=120)
    layouts = plan_meshes(from_dict(MeshConfig, SPLIT, "mesh"), 4)
    for rank, groups in enumerate(results):
        for role, layout in layouts.items():
            if not layout.contains(rank):
                assert groups[role] is None, (rank, role)
                continue
            assert groups[role]["tp"] == layout.group_of(layout.tp_groups(), rank)
            assert groups[role]["dp"] == layout.group_of(layout.dp_groups(), rank)
            assert groups[role]["pp"] == layout.group_of(layout.pp_groups(), rank)
    assert results[0]["actor"]["tp"] == [0, 1] and results[3]["critic"]["pp"] == [2, 3]
    assert results[1]["rollout"]["dp"] == [0, 1]

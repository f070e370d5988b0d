"""`mesh.roles` follows from the run when unset; a list that names other roles is refused, never overwritten."""

import pytest

from rlhf.config import load_config
from rlhf.errors import ConfigError
from rlhf.orchestration.preflight import mesh_config
from rlhf.orchestration.schema import RlhfConfig


def _config(*overrides: str) -> RlhfConfig:
    return load_config(RlhfConfig, "configs/tiny_cpu.yaml", list(overrides))


def test_unset_roles_are_those_the_run_uses():
    assert _config().mesh.roles is None
    assert mesh_config(_config()).roles == ["actor", "rollout"]
    assert mesh_config(_config("algo.kl.coef=0.01", "algo.advantage.kind=gae")).roles == [
        "actor", "critic", "ref", "rollout"]


def test_roles_that_match_the_run_are_kept_in_any_order():
    assert mesh_config(_config("algo.kl.coef=0.01", "mesh.roles=[rollout,ref,actor]")).roles == [
        "actor", "ref", "rollout"]


@pytest.mark.parametrize("overrides, message", [
    (["mesh.roles=[actor,ref,rollout]"],
     "mesh.roles=['actor', 'ref', 'rollout'], but this run uses ['actor', 'rollout'] (no ref, critic or reward): "
     "remove mesh.roles (the roles follow from algo and reward) or set mesh.roles=['actor', 'rollout']"),
    (["mesh.roles=[actor,rollout]", "algo.kl.coef=0.01", "algo.advantage.kind=gae"],
     "mesh.roles=['actor', 'rollout'], but this run uses ['actor', 'critic', 'ref', 'rollout'] (critic: "
     "algo.advantage.kind=gae; ref: algo.kl.coef > 0): remove mesh.roles (the roles follow from algo and reward) "
     "or set mesh.roles=['actor', 'critic', 'ref', 'rollout']"),
])
def test_roles_that_differ_from_the_run_are_a_config_error(overrides, message):
    with pytest.raises(ConfigError) as error:
        mesh_config(_config(*overrides))
    assert str(error.value) == message



def test_context_parallel_plans_and_trains_packed_micro_batches_only():
    from rlhf.orchestration.setting_checks import check_context_parallel
    from rlhf.parallel.meshes import plan_meshes

    cfg = _config("mesh.actor.cp=2")
    assert plan_meshes(mesh_config(cfg), 4)["actor"].describe() == "tp1 x cp2 x dp2 x pp1 on ranks 0..3"
    check_context_parallel(cfg)  # the budgets default to auto: packed
    with pytest.raises(ConfigError) as error:
        check_context_parallel(_config("mesh.actor.cp=2", "actor.max_tokens_per_microbatch=0"))
    assert str(error.value) == ("mesh.actor.cp=2 shards packed micro-batches only, but actor.max_tokens_per_microbatch"
                                "=0 (row counts); set actor.max_tokens_per_microbatch to a token budget or "
                                "mesh.actor.cp=1")
    check_context_parallel(_config("mesh.actor.cp=2", "actor.max_tokens_per_microbatch=64"))
    with pytest.raises(ConfigError) as error:
        plan_meshes(mesh_config(_config("mesh.rollout.cp=2")), 4)
    assert str(error.value) == ("mesh.rollout.cp=2: rollout engines do not split sequences; set mesh.rollout.cp=1 (cp "
                                "applies to the training roles)")

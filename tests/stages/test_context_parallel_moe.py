"""Context parallelism on an MoE model (Qwen3-MoE, 4 experts, top-2): CP=2 = CP=1 on 2 ranks for the actor's
logprobs, its update with router losses on (losses, routing metrics, grads of router, experts and dense
weights), the critic's values and update, and routing replay (R2's recorded experts, R3's replayed ones), at
ep=1 and at ep=2 carved out of the cp ranks; on 4 ranks (slow) ep=4 over cp x dp (filler evens the packs of
the expert-parallel peers) and tp=2 x cp=2."""

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
sys.path.insert(0, str(Path(__file__).parent))
from fixtures import NUM_EXPERTS, make_moe_setup, shared_engine_algo  # noqa: E402
from test_context_parallel import short_batch  # noqa: E402

from rlhf.models.config import MoeConfig  # noqa: E402
from rlhf.models.routing_replay import UNKNOWN  # noqa: E402
from rlhf.parallel.layout import ParallelLayout  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402

BUDGET = 20  # short_batch's rows are 1..9 tokens: packs of 2-5 rows
ROUTER_LOSSES = MoeConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01)
EXPERT = re.compile(r"local_experts\.(\d+)\.")


def _grads(role, layout: ParallelLayout) -> dict[str, torch.Tensor]:
    """main_grad by parameter name, local experts renamed to their global index (`ep` ranks hold a share each)."""
    import torch.distributed as dist

    per_rank = NUM_EXPERTS // layout.ep
    first = layout.ep_rank(dist.get_rank()) * per_rank
    return {EXPERT.sub(lambda m: f"local_experts.{first + int(m.group(1))}.", name): param.main_grad.clone()
            for name, param in role.engine.module.named_parameters() if getattr(param, "main_grad", None) is not None}


def _roles(paths: dict, cache, layout: ParallelLayout) -> dict:
    """Actor (router losses on) and critic forwards and updates, R2 and R3 routing, on `short_batch` at `layout`."""
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.meshes import RoleMesh
    from rlhf.stages.config import UpdateConfig
    from rlhf.stages.policy_role import PolicyRole
    from rlhf.stages.value_roles import CriticRole
    from rlhf.train.config import OptimConfig

    mesh = RoleMesh("actor", layout, build_layout_groups(layout, cache))
    update = UpdateConfig(micro_batch_size=2, max_tokens_per_microbatch=BUDGET,
                          optim=OptimConfig(lr=1e-12, clip_grad=0.0))

    def actor(replay: str = "none") -> PolicyRole:
        return PolicyRole("actor", mesh, paths["model"], total_steps=1, update=update, routing_replay=replay,
                          moe_kwargs=ROUTER_LOSSES.build_kwargs())

    batch = short_batch()
    policy = actor()
    critic = CriticRole("critic", mesh, paths["model"], total_steps=1, update=update, value_head=True)
    out = {"logprobs": policy.logprobs(batch), "values": critic.values(batch)}
    batch = dataclasses.replace(batch, values_bt=out["values"], returns_bt=out["values"] + batch.advantages_bt)
    algo = shared_engine_algo()
    out["actor"], out["actor_grads"] = policy.update(batch, algo), _grads(policy, layout) if mesh.is_member else {}
    out["critic"], out["critic_grads"] = critic.update(batch, algo), _grads(critic, layout) if mesh.is_member else {}
    r2 = actor("r2")
    out["r2_logprobs"] = r2.logprobs(batch)
    out["r2_routing"] = r2.recorded_routing_bslk
    gen = torch.Generator().manual_seed(2)
    random = torch.rand(*batch.tokens_bs.shape, 2, NUM_EXPERTS, generator=gen).argsort(-1)[..., :2]
    random = random.to(torch.int16).masked_fill(batch.padding_mask_bs[..., None, None], UNKNOWN)
    r3 = actor("r3")
    out["r3_recorded"] = r3.logprobs(dataclasses.replace(batch, routed_experts_bslk=out["r2_routing"]))
    out["r3_recorded_metrics"] = r3.routing_metrics
    replayed = dataclasses.replace(batch, routed_experts_bslk=random)
    out["r3_random"] = r3.logprobs(replayed)
    out["r3_random_metrics"] = r3.routing_metrics
    if r3.routing_replay is not None:  # the experts the replaying forward used, gathered to the rows' layout
        r3.routing_replay.record = True
    with r3._output_mode():
        _, out["r3_used"] = r3._forward(replayed, lambda stats, mb: r3._token_stats(stats, mb)[0], r3._token_fn(),
                                        record_routing=True)
    out["random"] = random
    return out


def _world(paths: dict, layouts: dict) -> dict:
    from rlhf.parallel.groups import GroupCache

    cache = GroupCache()
    return {name: _roles(paths, cache, layout) for name, layout in layouts.items()}


def _assert_close(reference: dict, other: dict, contributor: bool) -> None:
    """Tensors and grads within 1e-5; then metrics within 1e-5 on the replica's contributor (others report none)."""
    assert reference.keys() == other.keys()
    for key, value in reference.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(other[key], value, atol=1e-5, rtol=0, msg=key)
        elif key.endswith("_grads"):  # every dense grad; the experts this rank holds (ep > 1: a share)
            dense = {name for name in value if not EXPERT.search(name)}
            assert value and dense <= other[key].keys() <= value.keys(), key
            for name, grad in other[key].items():
                torch.testing.assert_close(grad, value[name], atol=1e-5, rtol=1e-5, msg=f"{key} {name}")
    for key, value in reference.items():
        if isinstance(value, dict) and not key.endswith("_grads"):
            if contributor or key.endswith("_metrics"):  # replay agreement: over every rank of the layout
                assert other[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
            else:
                assert other[key] == {}, key


def _check_replay(run: dict) -> None:
    known = run["random"][..., 0, 0] != UNKNOWN
    assert torch.equal(run["r3_used"].sort(-1).values[known], run["random"].sort(-1).values[known])
    assert (run["r3_recorded"] - run["logprobs"]).abs().max() <= 1e-6
    assert run["r3_recorded_metrics"] == {"router_agreement": 1.0, "router_agreement_all_layers": 1.0}
    assert (run["r3_random"] - run["logprobs"]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def moe_cp_world(tmp_path_factory):
    layouts = {"cp1": ParallelLayout(), "cp2": ParallelLayout(cp=2), "cp2_ep2": ParallelLayout(cp=2, ep=2)}
    return run_distributed(_world, 2, make_moe_setup(tmp_path_factory.mktemp("moe")), layouts, timeout_s=900)


@pytest.mark.parametrize("layout", ["cp2", "cp2_ep2"])
def test_moe_cp2_equals_cp1(moe_cp_world, layout):
    """Routers on each cp rank's real tokens, their losses' shares adding up to cp=1's, expert grads summed over
    the expert-data-parallel group (cp included); R2 records and R3 replays each token's experts on the cp rank
    holding it."""
    cp1 = moe_cp_world[0]["cp1"]
    assert {"actor/moe/aux_loss", "actor/moe/router_entropy"} <= set(cp1["actor"])
    assert any("router" in name for name in cp1["actor_grads"])
    assert any(name.endswith("local_experts.3.linear_fc1.weight") for name in cp1["actor_grads"])
    _check_replay(cp1)
    for cp_rank, rank in enumerate(moe_cp_world):
        run = rank[layout]
        _check_replay(run)
        torch.testing.assert_close(run["r2_routing"], cp1["r2_routing"], atol=0, rtol=0)
        _assert_close(cp1, run, contributor=cp_rank == 0)


def _four_rank_world(paths: dict) -> dict:
    return _world(paths, {"dp2": ParallelLayout(dp=2), "cp2_dp2_ep4": ParallelLayout(cp=2, dp=2, ep=4),
                          "tp2": ParallelLayout(tp=2), "tp2_cp2": ParallelLayout(tp=2, cp=2)})


@pytest.mark.slow
def test_moe_cp2_on_four_ranks_equals_cp1(tmp_path):
    """ep=4 over cp=2 x dp=2 (the expert-parallel peers of two replicas: filler evens their packs) = dp=2; tp=2 x
    cp=2 = tp=2 (the router on every tp rank, on its cp rank's tokens)."""
    world = run_distributed(_four_rank_world, 4, make_moe_setup(tmp_path / "moe"), timeout_s=1200)
    for name, reference, ranks in (("cp2_dp2_ep4", "dp2", {0: 0, 1: 0, 2: 1, 3: 1}),
                                   ("tp2_cp2", "tp2", {0: 0, 1: 1, 2: 0, 3: 1})):
        for rank, same in ranks.items():  # same: the rank at the reference layout holding this rank's rows/shard
            base, run = world[same][reference], world[rank][name]
            _check_replay(run)
            torch.testing.assert_close(run["r2_routing"], base["r2_routing"], atol=0, rtol=0)
            _assert_close(base, run, contributor=(rank // 2 if name == "tp2_cp2" else rank % 2) == 0)


def test_moe_cp_layouts_pass_preflight_and_bad_ones_name_the_numbers(tmp_path):
    """ep carved out of cp x dp passes; an ep that does not divide cp x dp is one line naming the numbers."""
    from fixtures import trainer_config

    from rlhf.errors import ConfigError
    from rlhf.orchestration.preflight import preflight

    paths = make_moe_setup(tmp_path / "moe")
    budget = "actor.max_tokens_per_microbatch=64"
    preflight(trainer_config(paths, str(tmp_path), ["mesh.actor.cp=2", "mesh.actor.ep=2", budget]), world_size=2)
    with pytest.raises(ConfigError) as error:
        preflight(trainer_config(paths, str(tmp_path), ["mesh.actor.cp=2", "mesh.actor.ep=4", budget]), world_size=2)
    assert str(error.value) == ("mesh.actor: 2 ranks are not divisible by tp*ep*pp = 1*4*1 = 4; choose ep among "
                                "the divisors of cp*dp = 2")


def _grpo_runs(paths: dict, run_root: str) -> dict:
    from fixtures import run_trainer

    common = ["mesh.actor.ep=2", "algo.routing_replay=r3", "actor.recompute_old_logprobs=true",
              "trainer.val_before_train=false", "actor.max_tokens_per_microbatch=64"]
    return {name: run_trainer(paths, f"{run_root}/{name}", common + extra)
            for name, extra in (("dp2", []), ("cp2", ["mesh.actor.cp=2"]))}


@pytest.mark.slow
def test_grpo_with_an_moe_actor_at_cp2_ep2(tmp_path):
    """The trainer end to end with the actor at cp=2 x ep=2 (the experts split over its cp ranks; its resharded
    engine at dp=2 takes each expert from the cp rank holding it) and R3: the old-logprob forward replays the
    engine's routing everywhere (agreement 1, the first update exactly on policy), and the first step equals the
    actor at dp=2 x ep=2's (but the routing statistics, which are per micro-batch: dp=2 packs each half apart)."""
    runs = run_distributed(_grpo_runs, 2, make_moe_setup(tmp_path / "moe"), str(tmp_path / "runs"),
                           timeout_s=1200)[0]
    for name, history in runs.items():
        steps = [row for row in history if row["step"] > 0]
        assert len(steps) == 2, name
        for row in steps:
            assert row["actor/ppo_kl"] == 0.0 and row["rollout/router_agreement"] == 1.0, name
            assert row["rollout/logprob_diff_max"] < 1e-5 and "actor/moe/aux_loss" in row, name
    first = {name: next(row for row in history if row["step"] == 1) for name, history in runs.items()}
    keys = [k for k in first["dp2"] if k.startswith(("actor/", "rollout/reward")) and isinstance(first["dp2"][k], float)
            and not k.endswith(("_s", "/lr")) and "/moe/" not in k]
    assert "actor/pg_loss" in keys and "actor/grad_norm" in keys
    assert {k: first["cp2"][k] for k in keys} == pytest.approx({k: first["dp2"][k] for k in keys}, rel=1e-5, abs=1e-5)

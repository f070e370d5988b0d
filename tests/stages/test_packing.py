"""Packed (THD) token-budget micro-batches: the plan, the pack, and packed = padded on every role forward
(logprobs, entropy, values, losses in every aggregation mode, gradients) at tp1/dp2/tp2/pp2, dense and MoE."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_moe_setup, make_tiny_setup, shared_engine_algo  # noqa: E402
from test_roles import fixed_batch  # noqa: E402

from rlhf.algo.config import LossAggMode, PolicyLossConfig, ValueLossConfig  # noqa: E402
from rlhf.errors import ConfigError  # noqa: E402
from rlhf.rewards.config import RewardConfig  # noqa: E402
from rlhf.models.packing import PackedMicroBatch, pack  # noqa: E402
from rlhf.models.routing_replay import UNKNOWN  # noqa: E402
from rlhf.parallel.groups import GroupCache, build_layout_groups  # noqa: E402
from rlhf.parallel.layout import ParallelLayout  # noqa: E402
from rlhf.parallel.meshes import RoleMesh  # noqa: E402
from rlhf.stages.config import RefConfig, UpdateConfig, check_budget_fits  # noqa: E402
from rlhf.stages.micro_batches import pack_plan, row_lengths  # noqa: E402
from rlhf.stages.policy_role import PolicyRole  # noqa: E402
from rlhf.stages.value_roles import CriticRole, RewardModelRole  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402
from rlhf.train.config import OptimConfig  # noqa: E402

BUDGET = 20  # tokens per packed micro-batch: fixed_batch's rows are 3..10 tokens, so packs hold 2-5 rows
MODES = (LossAggMode.TOKEN_MEAN, LossAggMode.SEQ_MEAN_TOKEN_SUM, LossAggMode.SEQ_MEAN_TOKEN_MEAN,
         LossAggMode.TOKEN_SUM)


def test_pack_plan_fits_the_budget_balances_and_agrees_across_shards():
    lengths = torch.tensor([9, 1, 30, 4, 17, 8, 2, 25, 11, 6, 3, 14])
    plans = pack_plan(lengths, 2, 32, "actor.max_tokens_per_microbatch")
    assert len(plans[0]) == len(plans[1])  # expert-parallel peers run their micro-batches in step
    for shard, plan in enumerate(plans):
        local = lengths[6 * shard:6 * shard + 6].tolist()
        assert sorted(row for rows in plan for row in rows) == list(range(6))
        totals = [sum(local[row] for row in rows) for rows in plan]
        assert max(totals) <= 32 and max(totals) - min(totals) <= max(local)
    assert pack_plan(lengths, 1, 200, "k") == [[list(range(12))]]
    with pytest.raises(ConfigError) as error:
        pack_plan(lengths, 1, 29, "actor.max_tokens_per_microbatch")
    assert str(error.value) == ("actor.max_tokens_per_microbatch=29 is smaller than the longest row (30 tokens: "
                                "prompt + response); raise actor.max_tokens_per_microbatch to at least 30")


def test_pack_restarts_positions_per_sequence_and_unpacks_to_the_rows():
    rows = fixed_batch(4).trimmed()
    lengths = row_lengths(rows).tolist()
    packed = pack(rows, length=sum(lengths) + 3)
    assert packed.cu_seqlens_n.tolist() == [0, *torch.tensor(lengths + [3]).cumsum(0).tolist()]
    assert packed.position_ids_1t[0].tolist() == [p for n in lengths + [3] for p in range(n)]
    assert packed.padding_mask_1t.sum() == 3 and packed.tokens_bs.shape == (1, sum(lengths) + 3)
    unpacked_bs = packed.unpack(packed.tokens_1t.unsqueeze(-1)).squeeze(-1)
    valid_bs = ~rows.padding_mask_bs
    assert torch.equal(unpacked_bs[valid_bs], rows.tokens_bs[valid_bs]) and not unpacked_bs[~valid_bs].any()


def test_token_budget_config_errors_name_the_numbers():
    with pytest.raises(ConfigError, match=r"^max_tokens_per_microbatch=-1 must be auto, 0 \(row-count "
                                          r"micro-batches\) or a token count >= 1$"):
        UpdateConfig(max_tokens_per_microbatch=-1)
    with pytest.raises(ConfigError, match=r"^ref.max_tokens_per_microbatch=2.5 must be auto, 0"):
        RefConfig(max_tokens_per_microbatch=2.5)
    with pytest.raises(ConfigError, match=r"^forward_max_tokens_per_microbatch='auto' must be 0 \(row-count "):
        UpdateConfig(forward_max_tokens_per_microbatch="auto")
    with pytest.raises(ConfigError, match=r"^reward.model_max_tokens_per_microbatch=True must be auto, 0"):
        RewardConfig(model_max_tokens_per_microbatch=True)
    with pytest.raises(ConfigError) as error:
        check_budget_fits("critic.max_tokens_per_microbatch", 64, 80, "data.max_prompt_length=16 + "
                          "sampling.max_new_tokens=64")
    assert str(error.value) == ("critic.max_tokens_per_microbatch=64 is smaller than the longest row, 80 tokens "
                                "(data.max_prompt_length=16 + sampling.max_new_tokens=64); raise "
                                "critic.max_tokens_per_microbatch to at least 80")
    assert UpdateConfig(max_tokens_per_microbatch=64).forward_tokens_per_microbatch == 64
    assert UpdateConfig(max_tokens_per_microbatch=64,
                        forward_max_tokens_per_microbatch=256).forward_tokens_per_microbatch == 256


def test_preflight_refuses_a_budget_below_the_longest_row(tmp_path):
    from fixtures import trainer_config

    from rlhf.orchestration.preflight import preflight

    paths = make_tiny_setup(tmp_path / "tiny", num_train=16, num_val=4)
    cfg = trainer_config(paths, str(tmp_path), ["actor.max_tokens_per_microbatch=20", "actor.micro_batch_size=3"])
    with pytest.raises(ConfigError, match=r"^actor.max_tokens_per_microbatch=20 is smaller than the longest row, 21 "
                                          r"tokens \(data.max_prompt_length=16 \+ sampling.max_new_tokens=5\); "
                                          r"raise actor.max_tokens_per_microbatch to at least 21$"):
        preflight(cfg, world_size=2)  # and a packing actor takes any rows per rank (micro_batch_size=3)
    preflight(trainer_config(paths, str(tmp_path), ["actor.max_tokens_per_microbatch=21", "actor.micro_batch_size=3"]),
              world_size=2)


def _grads(role) -> dict[str, torch.Tensor]:
    return {name: param.main_grad.clone() for name, param in role.engine.module.named_parameters()
            if getattr(param, "main_grad", None) is not None}


def _roles(paths: dict, cache, layout, budget: int, modes, clip_grad: float = 1.0) -> dict:
    """Actor logprobs, entropy, SFT and RL updates (losses and grads per aggregation mode); critic values and
    update; reward-model scores. lr ~0, so one role serves every update."""
    mesh = RoleMesh("actor", layout, build_layout_groups(layout, cache))
    update = UpdateConfig(micro_batch_size=2, max_tokens_per_microbatch=budget,
                          optim=OptimConfig(lr=1e-12, clip_grad=clip_grad))
    actor = PolicyRole("actor", mesh, paths["model"], total_steps=1, update=update)
    critic = CriticRole("critic", mesh, paths["model"], total_steps=1, update=update, value_head=True)
    reward = RewardModelRole("reward", mesh, paths["model"], update=None, total_steps=0, micro_batch_size=2,
                             value_head=True, max_tokens_per_microbatch=(budget, "reward.model_max_tokens"))
    batch = fixed_batch()
    out = {"logprobs": actor.logprobs(batch), "values": critic.values(batch), "scores": reward.scores(batch)}
    with actor._output_mode():
        out["entropy"] = actor._forward(batch, lambda stats, mb: actor._token_stats(stats, mb)[1], actor._token_fn())
    if mesh.is_member:
        out["packed"] = all(isinstance(mb, PackedMicroBatch) == bool(budget)
                            for mb in actor._split(batch, (budget, "k"), 2)[1])
    batch = dataclasses.replace(batch, values_bt=out["values"], returns_bt=out["values"] + batch.advantages_bt)
    out["sft"] = actor.sft_update(batch)
    out["sft_grads/token-mean"] = _grads(actor) if mesh.is_member else {}
    for mode in modes:
        algo = shared_engine_algo(policy_loss=PolicyLossConfig(agg=mode), value_loss=ValueLossConfig(agg=mode))
        out[f"actor/{mode.value}"] = actor.update(batch, algo)
        out[f"actor_grads/{mode.value}"] = _grads(actor) if mesh.is_member else {}
        out[f"critic/{mode.value}"] = critic.update(batch, algo)
        out[f"critic_grads/{mode.value}"] = _grads(critic) if mesh.is_member else {}
    return out


def _dense_world(paths: dict, run_root: str) -> dict:
    from fixtures import ROW_COUNTS, run_trainer

    cache = GroupCache()
    runs = {"tp1": (ParallelLayout(), MODES), "dp2": (ParallelLayout(dp=2), MODES[:1]),
            "tp2": (ParallelLayout(tp=2), MODES[:1]), "pp2": (ParallelLayout(pp=2), MODES[:1])}
    out = {name: (_roles(paths, cache, layout, 0, modes), _roles(paths, cache, layout, BUDGET, modes))
           for name, (layout, modes) in runs.items()}
    # GRPO at dp=2: 16 rows of <= 21 tokens in packs of <= 24 split the groups of 4 across micro-batches
    common = ["trainer.val_before_train=false", *ROW_COUNTS]  # colocated on 2 ranks: every role at dp=2
    out["grpo"] = tuple(run_trainer(paths, f"{run_root}/{name}", common + extra) for name, extra in
                        (("padded", []), ("packed", ["actor.max_tokens_per_microbatch=24"])))
    return out


def _assert_packed_equals_padded(padded: dict, packed: dict, skip: tuple[str, ...] = ()) -> None:
    """Tensors and grads within 1e-6, metrics within 1e-6 (relative for the large sums) but those ending in
    `skip`."""
    assert padded.keys() == packed.keys()
    for key, value in padded.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(packed[key], value, atol=1e-6, rtol=0, msg=key)
        elif key.endswith(tuple(m.value for m in MODES)) and "grads" in key:
            assert value.keys() == packed[key].keys()
            for name, grad in value.items():
                torch.testing.assert_close(packed[key][name], grad, atol=1e-6, rtol=1e-6, msg=f"{key} {name}")
        elif isinstance(value, dict):
            assert value.keys() == packed[key].keys(), key
            kept = [k for k in value if not k.endswith(skip)]
            assert {k: packed[key][k] for k in kept} == pytest.approx({k: value[k] for k in kept}, rel=1e-6,
                                                                       abs=1e-6), key


@pytest.fixture(scope="module")
def dense_world(tmp_path_factory):
    paths = make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=8, num_val=4)
    return run_distributed(_dense_world, 2, paths, str(tmp_path_factory.mktemp("runs")), timeout_s=900)


def test_grpo_with_packing_matches_padded_end_to_end(dense_world):
    """The first step's rollouts, advantages (per group, before any micro-batching) and update agree."""
    padded, packed = dense_world[0]["grpo"]
    assert [row["step"] for row in packed] == [row["step"] for row in padded] and len(packed) >= 2
    first = next(row for row in padded if row["step"] == 1)
    first_packed = next(row for row in packed if row["step"] == 1)
    keys = [k for k in first if k.startswith(("actor/", "critic/advantages", "rollout/reward")) and
            not k.endswith(("_s", "/lr")) and isinstance(first[k], float)]
    assert "actor/pg_loss" in keys and "critic/advantages/mean" in keys
    assert {k: first_packed[k] for k in keys} == pytest.approx({k: first[k] for k in keys}, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("layout", ["tp1", "dp2", "tp2", "pp2"])
def test_packed_equals_padded_on_every_forward_and_update(dense_world, layout):
    for rank in dense_world:
        padded, packed = rank[layout]
        if "packed" in packed:  # the budget run packs, the other does not
            assert packed["packed"] and padded["packed"]
        _assert_packed_equals_padded(padded, packed)


def _replay(paths: dict, cache, budget: int) -> dict:
    """R2: the routing the actor's old-logprob forward records; R3: logprobs replaying given (random) experts."""
    from fixtures import NUM_EXPERTS

    layout = ParallelLayout(dp=2)

    def role(mode: str) -> PolicyRole:
        mesh = RoleMesh("actor", layout, build_layout_groups(layout, cache))
        return PolicyRole("actor", mesh, paths["model"], total_steps=1, routing_replay=mode, micro_batch_size=2,
                          update=UpdateConfig(micro_batch_size=2, max_tokens_per_microbatch=budget,
                                              optim=OptimConfig(lr=1e-12)))

    batch = fixed_batch()
    r2 = role("r2")
    out = {"r2_logprobs": r2.logprobs(batch)}
    # on padding the padded forward records the routers' choices for pad tokens, a packed one UNKNOWN
    out["r2_routing"] = r2.recorded_routing_bslk.masked_fill(batch.padding_mask_bs[..., None, None], UNKNOWN)
    gen = torch.Generator().manual_seed(2)
    random = torch.rand(*batch.tokens_bs.shape, 2, NUM_EXPERTS, generator=gen).argsort(-1)[..., :2]
    r3 = role("r3")
    random = random.to(torch.int16).masked_fill(batch.padding_mask_bs[..., None, None], UNKNOWN)  # as rollouts
    out["r3_random"] = r3.logprobs(dataclasses.replace(batch, routed_experts_bslk=random))
    out["r3_metrics"] = r3.routing_metrics
    return out


def _moe_world(paths: dict) -> dict:
    cache = GroupCache()
    layouts = {"ep1": ParallelLayout(dp=2), "ep2": ParallelLayout(dp=2, ep=2), "tp2": ParallelLayout(tp=2)}
    out = {name: (_roles(paths, cache, layout, 0, MODES[:1]), _roles(paths, cache, layout, BUDGET, MODES[:1]))
           for name, layout in layouts.items()}
    out["replay"] = (_replay(paths, cache, 0), _replay(paths, cache, BUDGET))
    return out


@pytest.fixture(scope="module")
def moe_world(tmp_path_factory):
    return run_distributed(_moe_world, 2, make_moe_setup(tmp_path_factory.mktemp("moe")), timeout_s=900)


@pytest.mark.parametrize("layout", ["ep1", "ep2", "tp2", "replay"])
def test_packed_equals_padded_for_an_moe_model(moe_world, layout):
    """Routers see no padding or filler (padding_mask), expert-parallel peers pack alike, and replayed experts
    follow each token into its pack (R2's recorded routing comes back in the rows' layout)."""
    for rank in moe_world:
        padded, packed = rank[layout]
        if "packed" in packed:
            assert packed["packed"] and padded["packed"]
        # the router's balance statistics are per micro-batch (not losses here: their coefficients are 0)
        _assert_packed_equals_padded(padded, packed, skip=("moe/aux_loss", "moe/z_loss"))
        if layout == "replay":
            assert (padded["r2_routing"] != UNKNOWN).any()
            assert padded["r3_metrics"] and padded["r3_metrics"] == packed["r3_metrics"]

"""MoE in the RL step, one 2-rank launch: the router losses' gradient is invariant to micro-batching and DP
(TrainEngine), the step's routing metrics equal megatron's own aux-loss tracker, actor (with router
losses), ref and critic give the same logprobs, losses, grads and values at ep=2 as at ep=1 (colocated), and
routing replay: the native engine's recorded experts equal the training forward's (R2 record) on a permuted
batch, and a replayed (R3) routing follows each row through DP balancing, length sorting, trimming and pp=2."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
from fixtures import NUM_EXPERTS, make_moe_setup, make_tiny_setup  # noqa: E402
from test_roles import fixed_batch  # noqa: E402

from rlhf.models.config import MoeConfig  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402

ROUTER_LOSSES = MoeConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01)


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    return make_moe_setup(tmp_path_factory.mktemp("moe"))


def _model(path: str, groups, **moe):
    from transformers import AutoConfig

    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import load_hf_weights

    model = build_gpt(AutoConfig.from_pretrained(path), groups, moe_kwargs=MoeConfig(**moe).build_kwargs())
    load_hf_weights(model, path)
    return model


def _router_loss_grads(path: str, cache) -> dict:
    """Grads of the router losses alone (the main loss is 0): megatron's plain forward-backward of one
    sequence x, against TrainEngine steps at dp=2 on [x], [x, x] (two micro-batches) and [x; x] (one of two
    rows): every batch is copies of x, so its token-weighted mean router loss is x's."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from rlhf.models.forward import forward_backward
    from rlhf.models.routing import RoutingRecorder
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine
    from tests.models.world import MicroBatch

    groups = build_layout_groups(ParallelLayout(dp=2), cache)
    x = fixed_batch(1).tokens_bs

    def zero_loss(logits, _micro_batch):
        return logits.sum() * 0.0, {}

    model = _model(path, groups, **vars(ROUTER_LOSSES))
    clear_aux_losses_tracker()
    with RoutingRecorder(model) as routing:
        forward_backward(model, [MicroBatch(x)], zero_loss, groups)
    tracker = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    reference = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    out = {"reference": reference, "tracker_aux_loss": tracker[tracker != 0].mean().item(),
           "metrics": routing.global_metrics(model, groups.layout_all, "moe/"), "experts": routing.topk_experts(),
           "engine": []}
    for micro in ([x], [x, x], [torch.cat([x, x])]):
        engine = TrainEngine(_model(path, groups, **vars(ROUTER_LOSSES)), groups,
                             OptimConfig(lr=1e-3, total_steps=1, clip_grad=0.0))
        engine.module.eval()  # as a colocated native engine sharing the parameters leaves it
        engine.train_step([MicroBatch(tokens) for tokens in micro], zero_loss)
        out["engine"].append({name: param.main_grad.clone() for name, param in engine.module.named_parameters()
                              if name in reference})
    return out


def _roles_at(paths: dict, cache, layout) -> dict:
    """Ref logprobs, the actor's update (router losses on, KL loss to the ref) and the critic's, at `layout`."""
    from fixtures import shared_engine_algo

    from rlhf.algo.kl import KLConfig
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.meshes import RoleMesh
    from rlhf.train.config import OptimConfig
    from rlhf.stages.config import UpdateConfig
    from rlhf.stages.policy_role import PolicyRole
    from rlhf.stages.value_roles import CriticRole


    def mesh(role: str) -> RoleMesh:
        return RoleMesh(role, layout, build_layout_groups(layout, cache))

    # one row per micro-batch: megatron's router losses are per micro-batch, so every layout must cut the
    # batch alike (dp=2 and tp=2 do, whatever the balancing)
    update = UpdateConfig(micro_batch_size=1, max_tokens_per_microbatch=0, optim=OptimConfig(lr=1e-2))
    algo = shared_engine_algo(kl=KLConfig(coef=0.1))
    batch = fixed_batch()
    ref = PolicyRole("ref", mesh("ref"), paths["model"], update=None, total_steps=1, micro_batch_size=2)
    actor = PolicyRole("actor", mesh("actor"), paths["model"], update=update, total_steps=1,
                       moe_kwargs=ROUTER_LOSSES.build_kwargs())
    critic = CriticRole("critic", mesh("critic"), paths["model"], update=update, total_steps=1, value_head=True)
    values_bt = critic.values(batch)
    batch = dataclasses.replace(batch, ref_logprobs_bt=ref.logprobs(batch), values_bt=values_bt,
                                returns_bt=values_bt + batch.advantages_bt)
    out = {"ref": batch.ref_logprobs_bt, "values": batch.values_bt, "actor_old": actor.logprobs(batch),
           "actor": actor.update(batch, algo), "critic": critic.update(batch, algo)}
    out["actor_after"], out["values_after"] = actor.logprobs(batch), critic.values(batch)
    return out


def _replay(paths: dict, cache) -> dict:
    """Rollouts with recorded routing from the native engine; then, on a row-permuted batch: R2's recorded
    routing (dp=2), R3 logprobs with the rollout's routing and with random routing at dp=2 (permuted, micro 2)
    and at pp=2 (unpermuted, micro 4)."""
    import torch.distributed as dist

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.parallel.meshes import RoleMesh
    from rlhf.rollout.native.engine import NativeEngine, NativeEngineConfig
    from rlhf.rollout.sampling_params import SamplingParams
    from rlhf.rollout.types import PromptBatch
    from rlhf.train.config import OptimConfig
    from rlhf.stages.batch import build_rollout_batch
    from rlhf.stages.config import UpdateConfig
    from rlhf.stages.exchange import gather_global_batch
    from rlhf.stages.policy_role import PolicyRole

    def role(layout: ParallelLayout, mode: str, update: bool = False) -> PolicyRole:
        mesh = RoleMesh("actor", layout, build_layout_groups(layout, cache))
        return PolicyRole("actor", mesh, paths["model"], total_steps=1, routing_replay=mode, micro_batch_size=2,
                          update=UpdateConfig(micro_batch_size=2, max_tokens_per_microbatch=0,
                                              optim=OptimConfig(lr=1e-3)) if update else None)

    dp2 = ParallelLayout(dp=2)
    generator_role = role(dp2, "none")
    engine = NativeEngine(generator_role.model, vocab_size=generator_role.vocab_size, config=NativeEngineConfig(
        max_batch_size=16, max_seq_len=32), eos_token_ids=(5, 9))
    engine.record_routing = True
    prompts = PromptBatch.from_token_lists([[6, 7, 8], [10, 11, 12, 13], [7, 14], [15, 6, 12, 16, 17]])
    rollouts = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=4))
    batch = build_rollout_batch(prompts, rollouts, sample_index_b=rollouts.prompt_index_r, scores_b=None)
    perm = torch.randperm(batch.size, generator=torch.Generator().manual_seed(1))
    permuted = batch.select(perm)
    out = {"batch": batch, "perm": perm, "rollouts_routing": rollouts.routed_experts_rslk}
    r2 = role(dp2, "r2", update=True)
    out["r2_logprobs"] = r2.logprobs(permuted)
    out["r2_routing"] = r2.recorded_routing_bslk
    natural = role(dp2, "none").logprobs(permuted)
    r3 = role(dp2, "r3")
    out["natural"], out["r3_rollout"] = natural, r3.logprobs(permuted)
    out["r3_rollout_metrics"] = r3.routing_metrics
    gen = torch.Generator().manual_seed(2)
    random = torch.rand(*batch.routed_experts_bslk.shape[:3], NUM_EXPERTS, generator=gen).argsort(-1)[..., :2]
    random = random.to(torch.int16)
    out["random"] = random
    out["r3_random_dp2"] = r3.logprobs(dataclasses.replace(permuted, routed_experts_bslk=random[perm]))
    out["r3_random_metrics"] = r3.routing_metrics
    tp2 = ParallelLayout(tp=2)  # each expert split over tp; the router sees every token
    r2_tp2 = role(tp2, "r2", update=True)
    r2_tp2.logprobs(permuted)
    out["r2_routing_tp2"] = r2_tp2.recorded_routing_bslk
    r3_tp2 = role(tp2, "r3")
    out["r3_rollout_tp2"] = r3_tp2.logprobs(permuted)
    out["r3_rollout_tp2_metrics"] = r3_tp2.routing_metrics
    out["r3_random_tp2"] = r3_tp2.logprobs(dataclasses.replace(batch, routed_experts_bslk=random))
    pp2 = role(ParallelLayout(pp=2), "r3")
    pp2.micro_batch_size = 4
    out["r3_random_pp2"] = pp2.logprobs(dataclasses.replace(batch, routed_experts_bslk=random))
    # the cross-mesh exchange: each rank contributes half the rows, trimmed to their own width
    local = batch.select(slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)).trimmed()
    out["exchanged"] = gather_global_batch(local, 2, dp2).routed_experts_bslk
    return out


def _checkpoint_across_layouts(path: str, cache) -> dict:
    """Layout-free checkpoints with experts: one step at dp2 x ep2 (distributed optimizer), saved; loaded at tp2
    (each expert split over tp), saved again; loaded back at dp2 x ep2. Each save's full tensors (weights and
    Adam moments, this rank's share), kind -> HF name -> tensor."""
    from pathlib import Path

    from rlhf.checkpoint import CheckpointManager, tensor_folders
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine
    from tests.models.world import MicroBatch

    def engine(layout: ParallelLayout) -> TrainEngine:
        groups = build_layout_groups(layout, cache)
        return TrainEngine(_model(path, groups, **vars(ROUTER_LOSSES)), groups,
                           OptimConfig(lr=1e-2, total_steps=2, use_distributed_optimizer=layout.dp > 1))

    def save(source: TrainEngine, step: int) -> tuple:
        manager = CheckpointManager(f"{path}-ckpt")
        written = manager.save(step, {"engine": source.state_dict()}, tensors={"engine": source.checkpoint_tensors()})
        state, manifest = manager.load(Path(written))
        return state["engine"], tensor_folders(Path(written), manifest, "engine")

    ep2, tp2 = ParallelLayout(dp=2, ep=2), ParallelLayout(tp=2)
    first = engine(ep2)
    first.train_step([MicroBatch(fixed_batch(1).tokens_bs)], lambda logits, _: (logits.float().square().mean(), {}))
    saves = [first.checkpoint_tensors()]
    for layout in (tp2, ep2):
        loaded = engine(layout)
        loaded.load_state_dict(*save(first, len(saves)))
        saves.append(loaded.checkpoint_tensors())
        first = loaded
    return {"saves": saves}


def _world(paths: dict) -> dict:
    from rlhf.parallel.groups import GroupCache
    from rlhf.parallel.layout import ParallelLayout

    cache = GroupCache()
    layouts = {"ep1": ParallelLayout(dp=2), "ep2": ParallelLayout(dp=2, ep=2), "tp2": ParallelLayout(tp=2)}
    return {"router_losses": _router_loss_grads(paths["model"], cache),
            "roles": {name: _roles_at(paths, cache, layout) for name, layout in layouts.items()},
            "replay": _replay(paths, cache), "checkpoint": _checkpoint_across_layouts(paths["model"], cache)}


@pytest.fixture(scope="module")
def moe_world(moe_setup):
    return run_distributed(_world, 2, moe_setup, timeout_s=600)


def test_router_loss_grads_do_not_grow_with_micro_batches_or_dp(moe_world):
    """Before the fix the engine's router-loss grads were 2x, 4x and 2x the reference here (summed over
    micro-batches and DP ranks), and none at all once a colocated engine had put the model in eval mode."""
    for rank in moe_world:
        losses = rank["router_losses"]
        router = [name for name in losses["reference"] if "router" in name]
        assert router and any(losses["reference"][name].abs().max() > 1e-4 for name in router)
        for run in losses["engine"]:
            assert sorted(run) == sorted(losses["reference"])
            for name, grad in losses["reference"].items():
                assert (run[name] - grad).abs().max() <= 1e-6 * max(1.0, float(grad.abs().max())), name


def test_routing_metrics_match_megatron_and_the_recorded_choices(moe_world):
    losses = moe_world[0]["router_losses"]
    metrics = losses["metrics"]
    assert metrics == moe_world[1]["router_losses"]["metrics"]
    assert metrics["moe/aux_loss"] == pytest.approx(losses["tracker_aux_loss"], rel=1e-6)
    for layer, experts_nk in losses["experts"].items():
        load = np.bincount(experts_nk.flatten().numpy(), minlength=NUM_EXPERTS)
        assert metrics[f"moe/max_load_fraction/layer_{layer}"] == pytest.approx(load.max() / load.sum())
    assert sorted(k for k in metrics if "/layer_" in k) == [f"moe/max_load_fraction/layer_{n}"
                                                            for n in sorted(losses["experts"])]


def test_actor_ref_critic_at_ep2_equal_ep1(moe_world):
    """The RL step's role outputs at ep=2 (each rank holds half the experts) equal ep=1's within 1e-6:
    ref and old logprobs, values, the actor's losses/grad norm/routing metrics and the weights after the step
    (seen through the logprobs and values after it)."""
    ep1, ep2 = moe_world[0]["roles"]["ep1"], moe_world[0]["roles"]["ep2"]
    for key in ("ref", "values", "actor_old", "actor_after", "values_after"):
        assert (ep1[key] - ep2[key]).abs().max() <= 1e-6, key
    assert (ep1["actor_after"] - ep1["actor_old"]).abs().max() > 1e-4  # the update moved the policy
    for rank in moe_world:  # each rank's shares of the losses, and the shared values
        for role in ("actor", "critic"):
            at_ep1, at_ep2 = rank["roles"]["ep1"][role], rank["roles"]["ep2"][role]
            assert sorted(at_ep1) == sorted(at_ep2)
            for key, value in at_ep1.items():
                assert at_ep2[key] == pytest.approx(value, abs=1e-6), key
    assert {"actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/moe/aux_loss"} <= set(ep1["actor"]) | set(
        ep1["critic"])
    assert any(key.startswith("actor/moe/max_load_fraction/") for key in ep1["actor"])


def test_actor_ref_critic_at_tp2_equal_ep1(moe_world):
    """At tp=2 (each expert split over tp, the router on every token as at tp=1) the role outputs equal dp=2's
    within 1e-6, and so do the step's global metrics (those dp=2's ranks share): grad norms, router losses,
    routing metrics."""
    ep1, tp2 = moe_world[0]["roles"]["ep1"], moe_world[0]["roles"]["tp2"]
    for key in ("ref", "values", "actor_old", "actor_after", "values_after"):
        assert (ep1[key] - tp2[key]).abs().max() <= 1e-6, key
    for role in ("actor", "critic"):
        at_ep1, other_rank = ep1[role], moe_world[1]["roles"]["ep1"][role]
        shared = [key for key, value in at_ep1.items() if other_rank[key] == pytest.approx(value, abs=1e-9)]
        assert f"{role}/grad_norm" in shared
        for key in shared:
            assert tp2[role][key] == pytest.approx(at_ep1[key], abs=1e-6), key
    assert "actor/moe/aux_loss" in tp2["actor"]


def test_checkpoint_with_experts_reloads_bitwise_across_ep2_and_tp2(moe_world):
    """Saved at dp2 x ep2, loaded at tp2 and saved, loaded back at dp2 x ep2: every full tensor (weights and Adam
    moments, experts included) bitwise equal."""
    saves = [{} for _ in moe_world[0]["checkpoint"]["saves"]]
    for rank in moe_world:
        for merged, save in zip(saves, rank["checkpoint"]["saves"]):
            for kind, tensors in save.items():
                merged.setdefault(kind, {}).update(tensors)
    first = saves[0]
    assert sorted(first) == ["exp_avg", "exp_avg_sq", "model"]
    assert any(".experts.3." in name for name in first["model"]) and first["exp_avg"]["lm_head.weight"].abs().max() > 0
    for later in saves[1:]:
        assert sorted(later) == sorted(first)
        for kind, tensors in first.items():
            assert sorted(later[kind]) == sorted(tensors)
            for name, tensor in tensors.items():
                assert torch.equal(later[kind][name], tensor), (kind, name)


def test_native_engine_records_the_routing_the_training_forward_takes(moe_world):
    """Per token and routed layer, on a row-permuted batch gathered over dp=2: the engine's recorded experts
    (prompt tokens in prefill, each response token in the decode step that fed it) = the training forward's
    own (R2's record); the last token of each row and the padding are unknown (-1)."""
    replay = moe_world[0]["replay"]
    batch, perm = replay["batch"], replay["perm"]
    rollout_bslk = batch.routed_experts_bslk[perm]
    known = rollout_bslk[:, :, 0, 0] >= 0
    assert torch.equal(rollout_bslk[..., 0] >= 0, known[..., None].expand(rollout_bslk.shape[:3]))
    lengths = (batch.prompt_lengths_b + batch.response_lengths_b)[perm]
    positions = torch.arange(known.shape[1])[None, :]
    assert torch.equal(known, positions < (lengths - 1)[:, None])
    trained = replay["r2_routing"]
    assert trained.shape == rollout_bslk.shape and trained.dtype == torch.int16
    assert torch.equal(trained.sort(-1).values[known], rollout_bslk.sort(-1).values[known].to(torch.int16))
    assert replay["r3_rollout_metrics"] == {"router_agreement": 1.0, "router_agreement_all_layers": 1.0}
    assert (replay["r2_logprobs"] - replay["natural"]).abs().max() == 0.0
    at_tp2 = replay["r2_routing_tp2"]  # at tp=2, R2 records the same routing
    assert at_tp2.shape == rollout_bslk.shape
    assert torch.equal(at_tp2.sort(-1).values[known], rollout_bslk.sort(-1).values[known].to(torch.int16))


def test_replayed_routing_follows_each_row_through_every_reordering(moe_world):
    replay = moe_world[0]["replay"]
    routed = replay["batch"].routed_experts_bslk
    for rank in moe_world:  # the exchange: each half at its own width, unknown (-1) beyond
        exchanged = rank["replay"]["exchanged"]
        for half in (slice(0, 4), slice(4, 8)):
            width = int((replay["batch"].prompt_lengths_b + replay["batch"].response_lengths_b)[half].max())
            assert torch.equal(exchanged[half, :width], routed[half, :width])
            assert bool((exchanged[half, width:] == -1).all())
    unpermute = torch.argsort(replay["perm"])
    # replaying the rollout's own routing changes nothing; a random routing changes the logprobs ...
    assert (replay["r3_rollout"] - replay["natural"]).abs().max() <= 1e-6
    assert (replay["r3_random_dp2"] - replay["natural"]).abs().max() > 1e-3
    # ... identically whether rows are permuted, DP-balanced, length-sorted and cut into micro-batches of 2 at
    # dp=2, or kept in order as one micro-batch of 4 per rank... at pp=2 (each stage replays its own layers)
    assert (replay["r3_random_dp2"][unpermute] - replay["r3_random_pp2"]).abs().max() <= 1e-6
    assert moe_world[1]["replay"]["r3_random_pp2"].equal(replay["r3_random_pp2"])
    # ... and at tp=2, where each rank holds every token's routing while the experts see its share of them
    assert (replay["r3_random_tp2"] - replay["r3_random_pp2"]).abs().max() <= 1e-6
    assert (replay["r3_rollout_tp2"] - replay["natural"]).abs().max() <= 1e-6
    assert replay["r3_rollout_tp2_metrics"] == {"router_agreement": 1.0, "router_agreement_all_layers": 1.0}
    agreement = replay["r3_random_metrics"]["router_agreement"]
    assert 0.0 < agreement < 0.5  # 1 in 6 top-2 sets of 4 experts agree by chance


def test_routing_replay_config_errors_name_the_fix(moe_setup, tmp_path):
    from fixtures import trainer_config

    from rlhf.errors import ConfigError
    from rlhf.orchestration.preflight import preflight

    with pytest.raises(ConfigError, match=r"^algo\.routing_replay='r4' is not one of none, r2, r3 \(r3: replay"):
        trainer_config(moe_setup, str(tmp_path), ["algo.routing_replay=r4"])
    dense = make_tiny_setup(tmp_path / "dense", num_train=8, num_val=4)
    with pytest.raises(ConfigError, match=rf"^algo\.routing_replay=r3 replays MoE routing, but model\.path="
                                          rf"{dense['model']} is a dense model; set algo\.routing_replay=none$"):
        preflight(trainer_config(dense, str(tmp_path), ["algo.routing_replay=r3"]), world_size=1)
    for engine in ("hf", "vllm"):  # (vllm: one of two problems when vLLM is not installed)
        with pytest.raises(ConfigError, match=rf"(^|  \d\. )algo\.routing_replay=r3 replays the rollout's routing, which "
                                              rf"rollout\.engine={engine} cannot record; use rollout\.engine=native"):
            preflight(trainer_config(moe_setup, str(tmp_path), ["algo.routing_replay=r3", f"rollout.engine={engine}"]),
                      world_size=1)
    with pytest.raises(ConfigError, match=r"^algo\.routing_replay=r2 records routing at mesh\.actor\.pp=1 only, "
                                          r"got pp=2; use algo\.routing_replay=r3 or mesh\.actor\.pp=1$"):
        preflight(trainer_config(moe_setup, str(tmp_path), ["algo.routing_replay=r2", "mesh.actor.pp=2"]),
                  world_size=2)
    with pytest.raises(ConfigError, match=r"^algo\.routing_replay=r3 with model\.recompute=true needs "
                                          r"mesh\.actor\.pp=1, got pp=2; set model\.recompute=false"):
        preflight(trainer_config(moe_setup, str(tmp_path), ["algo.routing_replay=r3", "mesh.actor.pp=2",
                                                            "model.recompute=true"]), world_size=2)
    preflight(trainer_config(moe_setup, str(tmp_path), ["algo.routing_replay=r3"]), world_size=1)


def _grpo_runs(paths: dict, run_root: str) -> dict:
    from fixtures import run_trainer

    common = ["mesh.actor.ep=2", "actor.recompute_old_logprobs=true", "trainer.val_before_train=false"]
    return {mode: run_trainer(paths, f"{run_root}/{mode}", common + [f"algo.routing_replay={mode}"])
            for mode in ("r3", "r2")}


@pytest.mark.slow
def test_grpo_at_ep2_with_routing_replay(moe_setup, tmp_path):
    """The trainer end to end (actor at ep=2, its resharded fp32 engine at ep=1): with R3 the old-logprob
    forward's own routing agrees with the engine's everywhere and, replaying it, the first update is exactly on
    policy (ppo_kl 0); with R2 the update replays the old-logprob forward's routing, so the same holds."""
    runs = run_distributed(_grpo_runs, 2, moe_setup, str(tmp_path), timeout_s=900)[0]
    for mode, history in runs.items():
        steps = [row for row in history if row["step"] > 0]
        assert len(steps) == 2, mode
        for row in steps:
            assert row["actor/ppo_kl"] == 0.0, mode
            assert row["rollout/routing_bytes_per_token"] == 2 * 2 * 2  # int16 x 2 routed layers x top-2
            assert row["rollout/logprob_diff_max"] < 1e-5
            assert "actor/moe/aux_loss" in row
            if mode == "r3":
                assert row["rollout/router_agreement"] == 1.0
            else:
                assert "rollout/router_agreement" not in row


def _grpo_at_tp2(paths: dict, run_root: str) -> list[dict]:
    from fixtures import run_trainer

    return run_trainer(paths, run_root, ["mesh.actor.tp=2", "mesh.ref.tp=2", "mesh.rollout.tp=1", "algo.kl.coef=0.01",
                                         "algo.routing_replay=r3", "model.moe.aux_loss_coeff=0.01",
                                         "model.moe.z_loss_coeff=0.001", "trainer.val_before_train=false"])


def test_grpo_with_an_moe_actor_at_tp2(moe_setup, tmp_path):
    """GRPO end to end with the actor and the ref at tp=2 (each expert split over tp), the native engine at
    tp=1 x dp=2 (the experts resharded from tp=2), R3, a KL loss and the router losses on: the engine's routing
    is the training forward's everywhere and the first update is exactly on policy (ppo_kl 0); the rollout
    logprobs equal the training forward's within 1e-5."""
    history = run_distributed(_grpo_at_tp2, 2, moe_setup, str(tmp_path), timeout_s=900)[0]
    steps = [row for row in history if row["step"] > 0]
    assert len(steps) == 2
    for row in steps:
        assert row["actor/ppo_kl"] == 0.0
        assert row["rollout/router_agreement"] == 1.0
        assert row["rollout/logprob_diff_max"] < 1e-5
        assert row["actor/moe/aux_loss"] > 0 and row["actor/grad_norm"] > 0


def _split_runs(paths: dict, run_root: str) -> dict:
    from fixtures import run_trainer

    split = ["mesh.placement=split", "mesh.roles=[actor,critic,ref,rollout]", "mesh.actor.ranks=[0,2]",
             "mesh.ref.ranks=[0,2]", "mesh.rollout.ranks=[0,2]", "mesh.critic.ranks=[2,4]", "algo.advantage.kind=gae",
             "algo.kl.coef=0.01", "algo.rollout_correction.enable=false", "actor.recompute_old_logprobs=true",
             "trainer.val_before_train=false", "model.moe.aux_loss_coeff=0.01"]
    return {ep: run_trainer(paths, f"{run_root}/ep{ep}", split + [f"mesh.{role}.ep={ep}" for role in
                                                                   ("actor", "ref", "critic")])
            for ep in (1, 2)}


@pytest.mark.slow
def test_split_placement_rl_step_at_ep2_equals_ep1(moe_setup, tmp_path):
    """PPO on 4 ranks, actor + ref + rollout on ranks 0-1 and the critic on 2-3, each at ep=2 vs ep=1: the
    same rollouts, losses, KL, grad norms and values per step within 1e-6."""
    runs = run_distributed(_split_runs, 4, moe_setup, str(tmp_path), timeout_s=900)[0]
    ep1, ep2 = ([row for row in runs[ep] if row["step"] > 0] for ep in (1, 2))
    assert len(ep1) == len(ep2) == 2
    for row1, row2 in zip(ep1, ep2):
        keys = [k for k in row1 if not k.startswith(("timing_s/", "memory/", "perf/throughput"))]
        assert {"actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"} <= set(keys)
        bad = {key: (row1[key], row2[key]) for key in keys if row2[key] != pytest.approx(row1[key], abs=1e-6, rel=1e-6)}
        assert not bad

"""Context parallelism: the chunk layout, and CP=2 = CP=1 on every role forward and update of packed micro-batches
(logprobs from the fused head with sum pi^2 and from full logits, entropy, values, scores, losses in every
aggregation mode, gradients), with a sequence of length 1 and one shorter than 2·cp chunks in the batch; the
one-line ConfigErrors of settings cp cannot run."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402
from test_packing import BUDGET, MODES, _roles  # noqa: E402
from test_roles import fixed_batch  # noqa: E402

from rlhf.errors import ConfigError  # noqa: E402
from rlhf.models.packing import pack  # noqa: E402
from rlhf.orchestration.preflight import preflight  # noqa: E402
from rlhf.platform.context_parallel import global_order, local_positions, padded_length  # noqa: E402
from rlhf.stages.micro_batches import row_lengths, schedule_lengths  # noqa: E402
from rlhf.parallel.groups import GroupCache  # noqa: E402
from rlhf.parallel.layout import ParallelLayout  # noqa: E402
from rlhf.testing.distributed import FakeGroup, run_distributed  # noqa: E402


def short_batch():
    """`fixed_batch` with row 0 one token long (a prompt token, no response) and row 3 three (< 2·cp chunks)."""
    batch = fixed_batch()
    prompt_b, response_b = batch.prompt_lengths_b.clone(), batch.response_lengths_b.clone()
    prompt_b[0], response_b[0] = 1, 0
    prompt_b[3], response_b[3] = 2, 1
    mask = torch.arange(batch.response_mask_bt.shape[1])[None, :] < response_b[:, None]
    return dataclasses.replace(batch, prompt_lengths_b=prompt_b, response_lengths_b=response_b,
                               response_mask_bt=mask, loss_mask_bt=mask, advantages_bt=batch.advantages_bt * mask,
                               old_logprobs_bt=batch.old_logprobs_bt * mask)


def test_each_cp_rank_holds_chunks_i_and_2cp_minus_1_minus_i():
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)  # lengths 4 and 8 at cp=2: chunks of 1 and 2 tokens
    assert local_positions(cu, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert local_positions(cu, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    gathered = torch.cat([local_positions(cu, 2, 0), local_positions(cu, 2, 1)])
    assert gathered[global_order(cu, 2)].tolist() == list(range(12))
    assert [padded_length(n, 2) for n in (1, 3, 4, 5)] == [4, 4, 4, 8]



def test_cp_pack_pads_each_sequence_and_keeps_the_rows():
    rows = short_batch().trimmed()
    packed = pack(rows, cp_group=FakeGroup(2, 1))
    lengths = (rows.prompt_lengths_b + rows.response_lengths_b).tolist()
    spans = [padded_length(n, 2) for n in lengths]
    assert packed.cu_seqlens_n.tolist() == [0, *torch.tensor(spans).cumsum(0).tolist()]
    assert packed.tokens_bs.shape == (1, sum(spans) // 2) and int((~packed.padding_mask_1t).sum()) == sum(lengths)
    unpacked_bs = packed.unpack(packed.tokens_1t.unsqueeze(-1)).squeeze(-1)
    valid_bs = ~rows.padding_mask_bs
    assert torch.equal(unpacked_bs[valid_bs], rows.tokens_bs[valid_bs])
    assert torch.equal(packed.tokens_bs[0], packed.tokens_1t[0, local_positions(packed.cu_seqlens_n, 2, 1)])


def test_cp_pipeline_packs_share_one_local_length_with_a_filler_sequence():
    """cp=2 x pp=2: every pack of a schedule is the longest's length (a multiple of 2·cp), so every cp rank and
    stage sees one local length `T / cp`; the filler is a sequence of its own that no row reads."""
    rows = short_batch().trimmed()
    packs = [rows.select(torch.tensor(bin_rows)).trimmed() for bin_rows in ([0, 3], [1, 2, 4])]
    per_pack = [row_lengths(pack_rows).tolist() for pack_rows in packs]
    assert per_pack[0] == [1, 3]
    assert schedule_lengths(per_pack, 1, 1) == [4, sum(per_pack[1])]
    own = [sum(padded_length(n, 2) for n in lengths) for lengths in per_pack]
    assert schedule_lengths(per_pack, 2, 1) == own and schedule_lengths(per_pack, 2, 2) == [max(own)] * 2
    length = max(own)
    assert own[0] < length and length % 4 == 0
    for cp_rank in (0, 1):
        packed = [pack(pack_rows, length=length, cp_group=FakeGroup(2, cp_rank)) for pack_rows in packs]
        assert {mb.tokens_bs.shape for mb in packed} == {(1, length // 2)}
        short = packed[0]  # [1, 3] padded to 4 + 4, then a filler sequence of length - 8 tokens
        assert short.cu_seqlens_n.tolist() == [0, 4, 8, length]
        assert int((~short.padding_mask_1t).sum()) == 4 and bool(short.padding_mask_1t[0, 8:].all())
        unpacked_bs = short.unpack(short.tokens_1t.unsqueeze(-1)).squeeze(-1)
        valid_bs = ~packs[0].padding_mask_bs
        assert torch.equal(unpacked_bs[valid_bs], packs[0].tokens_bs[valid_bs])
        assert torch.equal(short.tokens_bs[0], short.tokens_1t[0, local_positions(short.cu_seqlens_n, 2, cp_rank)])
        assert not short.wanted_bs[0, short.padding_mask_bs[0]].any()  # no loss reads padding or filler


def _cp_world(paths: dict) -> dict:
    import test_packing

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.meshes import RoleMesh
    from rlhf.stages.policy_role import PolicyRole

    test_packing.fixed_batch = short_batch  # `_roles` runs every forward and update on the short batch
    cache = GroupCache()
    out = {}
    for name, layout in (("cp1", ParallelLayout()), ("cp2", ParallelLayout(cp=2))):
        out[name] = _roles(paths, cache, layout, BUDGET, MODES, clip_grad=0.0)  # grads as they come
        for fused in (True, False):  # the ref: logprobs (+ sum pi^2) from the fused head, and from full logits
            ref = PolicyRole("ref", RoleMesh("ref", layout, build_layout_groups(layout, cache)), paths["model"],
                             update=None, total_steps=0, micro_batch_size=2, fused_head=fused,
                             max_tokens_per_microbatch=(BUDGET, "ref.max_tokens_per_microbatch"))
            out[name][f"ref_fused_{fused}"] = ref.logprobs(short_batch(), with_sum_pi_squared=fused)
    layout = ParallelLayout(cp=2)
    rows_ref = PolicyRole("ref", RoleMesh("ref", layout, build_layout_groups(layout, cache)), paths["model"],
                          update=None, total_steps=0, micro_batch_size=2,
                          max_tokens_per_microbatch=(0, "ref.max_tokens_per_microbatch"))
    try:  # a role built outside preflight (a LoRA ref on the actor's cp mesh) still says what to set
        rows_ref.logprobs(short_batch())
    except ConfigError as error:
        out["rows_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def cp_world(tmp_path_factory):
    paths = make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=8, num_val=4)
    return run_distributed(_cp_world, 2, paths, timeout_s=900)


def test_cp_refuses_row_count_micro_batches(cp_world):
    """(MoE models run at cp > 1: `test_context_parallel_moe`.)"""
    for rank in cp_world:
        assert rank["rows_error"] == ("the ref role runs at cp=2, which shards packed micro-batches only; set "
                                      "ref.max_tokens_per_microbatch > 0")


def _assert_tensors_and_grads_close(cp1: dict, cp2: dict) -> dict:
    """Outputs within 1e-5 and grads within 1e-5 (abs and rel); returns cp1's other dict entries (metrics)."""
    metrics = {}
    for key, value in cp1.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(cp2[key], value, atol=1e-5, rtol=0, msg=key)
        elif "grads" in key:
            assert value and value.keys() == cp2[key].keys()
            for name, grad in value.items():
                torch.testing.assert_close(cp2[key][name], grad, atol=1e-5, rtol=1e-5, msg=f"{key} {name}")
        elif isinstance(value, dict):
            metrics[key] = value
    return metrics


def test_cp2_equals_cp1_on_every_forward_and_update(cp_world):
    """Outputs, metrics and (unclipped) grads within 1e-5 on both cp ranks against the one-rank replica: each cp
    rank holds the whole replica's grads after DDP's sum over dp x cp."""
    cp1 = cp_world[0]["cp1"]
    for cp_rank, rank in enumerate(cp_world):
        cp2 = rank["cp2"]
        assert cp1.keys() == cp2.keys()
        for key, value in _assert_tensors_and_grads_close(cp1, cp2).items():
            # metrics: from the replica's contributor (cp rank 0) only
            assert cp2[key] == (pytest.approx(value, rel=1e-5, abs=1e-5) if cp_rank == 0 else {}), key
        assert cp2["packed"] is True and cp1["packed"] is True


def test_cp_config_errors_name_the_setting(tmp_path):
    paths = make_tiny_setup(tmp_path / "tiny", num_train=16, num_val=4)
    cases = [(["mesh.actor.cp=2", "actor.max_tokens_per_microbatch=0"], 2, "mesh.actor.cp=2 shards packed "
              "micro-batches only, but "
              "actor.max_tokens_per_microbatch=0 (row counts); set actor.max_tokens_per_microbatch to a token budget "
              "or mesh.actor.cp=1"),
             (["mesh.teacher.cp=2"], 2, "mesh.teacher.cp=2: the teacher forwards do not split sequences; set "
              "mesh.teacher.cp=1"),
             (["mesh.actor.cp=3", "actor.max_tokens_per_microbatch=64"], 2, "mesh.actor: 2 ranks are not divisible "
              "by tp*cp*pp = 1*3*1 = 3; choose tp, cp and pp whose product divides 2")]
    for overrides, world_size, message in cases:
        with pytest.raises(ConfigError) as error:
            preflight(trainer_config(paths, str(tmp_path), overrides), world_size=world_size)
        assert str(error.value) == message
    preflight(trainer_config(paths, str(tmp_path), ["mesh.actor.cp=2", "actor.max_tokens_per_microbatch=64"]),
              world_size=2)
    preflight(trainer_config(paths, str(tmp_path), ["mesh.actor.cp=2"]), world_size=2)  # auto: packed
    preflight(trainer_config(paths, str(tmp_path), ["mesh.actor.cp=2", "mesh.actor.pp=2",
                                                    "actor.max_tokens_per_microbatch=64"]), world_size=4)


CLOCK_PREFIXES = ("timing_s/", "perf/", "memory/")


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(CLOCK_PREFIXES)}


def _loop_world(paths: dict, root: str) -> dict:
    from fixtures import run_trainer

    from rlhf.stages import micro_batches

    packs_at: dict[int, int] = {}  # cp size -> packs made: the runs really shard their micro-batches
    plain_pack = micro_batches.pack

    def counting_pack(rows, **kwargs):
        size = kwargs["cp_group"].size() if kwargs.get("cp_group") is not None else 1
        packs_at[size] = packs_at.get(size, 0) + 1
        return plain_pack(rows, **kwargs)

    micro_batches.pack = counting_pack
    packed = ["trainer.val_before_train=false", "actor.max_tokens_per_microbatch=24",
              "critic.max_tokens_per_microbatch=24"]
    ppo = ["algo.advantage.kind=gae", "mesh.critic.cp=2"]
    out = {"grpo_cp1": run_trainer(paths, root, packed + ["run.name=grpo1"]),
           "grpo_cp2": run_trainer(paths, root, packed + ["run.name=grpo2", "mesh.actor.cp=2"]),
           "ppo_cp1": run_trainer(paths, root, packed + ["run.name=ppo1", "algo.advantage.kind=gae"])}
    resumable = packed + ppo + ["run.name=ppo2", "mesh.actor.cp=2", "checkpoint.every=1",
                                "actor.optim.use_distributed_optimizer=true"]  # its shards span dp x cp
    out["ppo_cp2"] = run_trainer(paths, root, resumable)
    out["ppo_cp2_resumed"] = run_trainer(paths, root, resumable + [f"checkpoint.resume={root}/ppo2/checkpoints/"
                                                                   "step_1"])
    out["packs_at"] = packs_at
    out["sft_cp1"], out["sft_cp2"] = (_sft_losses(paths, root, cp) for cp in (1, 2))
    return out


def _sft_losses(paths: dict, root: str, cp: int) -> list[float]:
    """`rlhf sft`'s per-step losses with the actor at `cp` (packed micro-batches)."""
    import json

    from fixtures import trainer_config

    from rlhf.orchestration.sft import run_sft, sft_preflight
    from rlhf.run_dir import close_run, setup_run

    cfg = trainer_config(paths, root, [f"mesh.actor.cp={cp}", "actor.max_tokens_per_microbatch=64", "sft.steps=2",
                                       "sft.batch_size=8", f"run.name=sft{cp}", f"sft.out_dir={root}/sft{cp}_out"])
    sft_preflight(cfg, 2)
    run_dir = setup_run(cfg.run, cfg, prefix="sft")
    try:
        run_sft(cfg, cfg.sft, run_dir)
    finally:
        close_run()
    rows = [json.loads(line) for line in (run_dir.path / "metrics.jsonl").read_text().splitlines()]
    return [row["sft/loss"] for row in rows if "sft/loss" in row]


@pytest.mark.slow
def test_rl_loop_at_cp2_matches_cp1_and_resumes_exactly(tmp_path):
    """GRPO (actor at cp=2) and PPO (actor and critic at cp=2), 2 ranks: the first step equals cp=1's, and a resume
    from step 1 gives step 2 exactly; `rlhf sft` at cp=2 gives cp=1's losses."""
    paths = make_tiny_setup(tmp_path / "tiny", num_train=16, num_val=4)
    world = run_distributed(_loop_world, 2, paths, str(tmp_path / "runs"), timeout_s=900)[0]
    assert world["packs_at"][1] > 0 and world["packs_at"][2] > 0
    for algo in ("grpo", "ppo"):
        cp1, cp2 = world[f"{algo}_cp1"], world[f"{algo}_cp2"]
        assert [row["step"] for row in cp2] == [row["step"] for row in cp1] == [1, 2]
        keys = [k for k in cp1[0] if k.startswith(("actor/", "critic/", "rollout/reward")) and
                not k.endswith(("_s", "/lr")) and isinstance(cp1[0][k], float)]
        assert "actor/pg_loss" in keys and (algo == "grpo" or "critic/vf_loss" in keys)
        assert {k: cp2[0][k] for k in keys} == pytest.approx({k: cp1[0][k] for k in keys}, rel=1e-5, abs=1e-5)
    assert len(world["sft_cp1"]) == 2 and world["sft_cp2"] == pytest.approx(world["sft_cp1"], abs=1e-5)
    resumed = world["ppo_cp2_resumed"]
    assert [row["step"] for row in resumed] == [2]
    assert _comparable(resumed[0]) == _comparable(world["ppo_cp2"][1])


def _cp_tp_world(paths: dict) -> dict:
    import test_packing

    test_packing.fixed_batch = short_batch
    cache = GroupCache()
    return {"cp1": _roles(paths, cache, ParallelLayout(tp=2), BUDGET, MODES[:1], clip_grad=0.0),
            "cp2": _roles(paths, cache, ParallelLayout(tp=2, cp=2), BUDGET, MODES[:1], clip_grad=0.0)}


@pytest.mark.slow
def test_cp2_tp2_equals_tp2_on_four_ranks(tmp_path):
    """CP=2 x TP=2: every tp rank's vocab / head shards see the same outputs and grads as at cp=1."""
    paths = make_tiny_setup(tmp_path / "tiny", num_train=8, num_val=4)
    world = run_distributed(_cp_tp_world, 4, paths, timeout_s=900)
    for rank in (0, 1):  # tp ranks 0 and 1 of cp rank 0; at cp=1 ranks 2, 3 are outside the layout
        cp1, cp2 = world[rank]["cp1"], world[rank]["cp2"]
        for key, value in _assert_tensors_and_grads_close(cp1, cp2).items():
            if value:
                assert cp2[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    for rank in (2, 3):  # cp rank 1 holds the same shards' grads
        for key, value in world[rank - 2]["cp1"].items():
            if "grads" in key:
                for name, grad in value.items():
                    torch.testing.assert_close(world[rank]["cp2"][key][name], grad, atol=1e-5, rtol=1e-5)


def _cp_pp_world(paths: dict) -> dict:
    import test_packing

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.meshes import RoleMesh
    from rlhf.stages.micro_batches import pack_plan, packed_micro_batches
    from rlhf.stages.policy_role import PolicyRole

    test_packing.fixed_batch = short_batch
    cache = GroupCache()
    out = {}
    for name, layout in (("cp1", ParallelLayout()), ("cp2pp2", ParallelLayout(cp=2, pp=2))):
        out[name] = _roles(paths, cache, layout, BUDGET, MODES, clip_grad=0.0)
        ref = PolicyRole("ref", RoleMesh("ref", layout, build_layout_groups(layout, cache)), paths["model"],
                         update=None, total_steps=0, micro_batch_size=2, fused_head=False,
                         max_tokens_per_microbatch=(BUDGET, "ref.max_tokens_per_microbatch"))
        out[name]["ref_full_logits"] = ref.logprobs(short_batch())
    layout = ParallelLayout(cp=2, pp=2)
    out["stage"] = layout.coords(torch.distributed.get_rank()).pp_rank
    bins = pack_plan(row_lengths(short_batch()), 1, BUDGET, "k")[0]
    micro = packed_micro_batches(short_batch(), bins, build_layout_groups(layout, cache))
    out["local_lengths"] = [mb.tokens_bs.shape[1] for mb in micro]
    out["fillers"] = sum(len(mb.cu_seqlens_n) - 1 > mb.rows.size for mb in micro)
    return out


def _global_names(grads: dict, stage: int, layers_per_stage: int, names: set) -> dict:
    """A pipeline stage's grads under the one-stage model's names (its layers offset; the tied output layer, whose
    grad the embedding group summed, as the embedding's)."""
    out = {}
    for name, grad in grads.items():
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{int(index) + stage * layers_per_stage}.{rest}"
        elif name == "output_layer.weight" and name not in names:
            name = "embedding.word_embeddings.weight"
        out[name] = grad
    return out


@pytest.mark.slow
def test_cp2_pp2_equals_cp1_on_four_ranks(tmp_path):
    """CP=2 x PP=2 (packs of one length per schedule, p2p of the local shard): outputs, metrics and every
    stage's grads (on both cp ranks) within 1e-5 of the one-rank run, in all four aggregation modes."""
    paths = make_tiny_setup(tmp_path / "tiny", num_train=8, num_val=4)
    world = run_distributed(_cp_pp_world, 4, paths, timeout_s=1500)
    cp1 = world[0]["cp1"]
    lengths = world[0]["local_lengths"]  # one local length for every pack, cp rank and stage
    assert len(lengths) > 1 and all(rank["local_lengths"] == lengths[:1] * len(lengths) for rank in world)
    assert world[0]["fillers"] > 0  # some pack was filled up to the schedule's length
    covered: set[str] = set()
    for rank in world:
        cp2 = rank["cp2pp2"]
        assert cp1.keys() == cp2.keys() and cp2["packed"] is True
        for key, value in cp1.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(cp2[key], value, atol=1e-5, rtol=0, msg=key)
            elif "grads" in key:
                grads = _global_names(cp2[key], rank["stage"], 1, set(value))
                assert grads and set(grads) <= set(value), key
                covered |= {f"{key} {name}" for name in grads}
                for name, grad in grads.items():
                    torch.testing.assert_close(grad, value[name], atol=1e-5, rtol=1e-5, msg=f"{key} {name}")
            elif isinstance(value, dict) and cp2[key]:  # metrics: the last stage's cp rank 0 (rank 2)
                assert cp2[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    assert all(world[2]["cp2pp2"][key] for key in cp1 if key.startswith(("actor/", "critic/")))
    assert covered == {f"{key} {name}" for key, value in cp1.items() if "grads" in key for name in value}


def _loop_pp_world(paths: dict, root: str) -> dict:
    from fixtures import run_trainer

    from rlhf.stages import micro_batches

    local_lengths: set[int] = set()  # cp=2 packs' local lengths, all of one schedule's alike
    plain_pack = micro_batches.pack

    def recording_pack(rows, **kwargs):
        packed = plain_pack(rows, **kwargs)
        if packed.local_index_l is not None:
            local_lengths.add(packed.tokens_bs.shape[1])
        return packed

    micro_batches.pack = recording_pack
    packed = ["trainer.val_before_train=false", "actor.max_tokens_per_microbatch=24"]
    resumable = packed + ["run.name=grpo_cp2pp2", "mesh.actor.cp=2", "mesh.actor.pp=2", "checkpoint.every=1",
                          "actor.optim.use_distributed_optimizer=true"]
    out = {"cp1": run_trainer(paths, root, packed + ["run.name=grpo_cp1"]),
           "cp2pp2": run_trainer(paths, root, resumable)}
    out["resumed"] = run_trainer(paths, root, resumable + [f"checkpoint.resume={root}/grpo_cp2pp2/checkpoints/step_1"])
    out["cp_packs"] = bool(local_lengths)
    return out


@pytest.mark.slow
def test_grpo_loop_at_cp2_pp2_matches_cp1_and_resumes_exactly(tmp_path):
    """GRPO with the actor at cp=2 x pp=2 on 4 ranks: the first step equals the actor at dp=4's, and a resume from
    step 1 gives step 2 exactly."""
    paths = make_tiny_setup(tmp_path / "tiny", num_train=16, num_val=4)
    world = run_distributed(_loop_pp_world, 4, paths, str(tmp_path / "runs"), timeout_s=1500)[0]
    cp1, cp2 = world["cp1"], world["cp2pp2"]
    assert world["cp_packs"]  # the actor's micro-batches really were split over cp
    assert [row["step"] for row in cp2] == [row["step"] for row in cp1] == [1, 2]
    keys = [k for k in cp1[0] if k.startswith(("actor/", "critic/", "rollout/reward")) and
            not k.endswith(("_s", "/lr")) and isinstance(cp1[0][k], float)]
    assert "actor/pg_loss" in keys
    assert {k: cp2[0][k] for k in keys} == pytest.approx({k: cp1[0][k] for k in keys}, rel=1e-5, abs=1e-5)
    assert [row["step"] for row in world["resumed"]] == [2]
    assert _comparable(world["resumed"][0]) == _comparable(cp2[1])

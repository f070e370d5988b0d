"""Multi-turn GRPO end to end on 2 gloo ranks (native engine, colocated, dp2): an agent function of the user's
(three turns, a user observation after each) and the built-in tool loop with a calculator; the trainer sees
only the sampled tokens (interior zeros), and its recompute of their logprobs matches the rollout's. At tp2 the
agent's observations name the rank that rendered them: only TP rank 0 runs agents, the other follows; split
placement (actor on rank 0, rollout on rank 1) runs the same loop, synchronous and one step off; the fork
history (with overlong shaping on the whole trajectory), a replay of its dump, and fork with DAPO dynamic
sampling."""

import json

import pytest
import torch

from rlhf.data.char_tokenizer import build_chat_char_tokenizer
from rlhf.errors import ConfigError
from rlhf.models.init import InitModelConfig, init_hf_model
from rlhf.testing.distributed import run_distributed

AGENT = '''
import torch.distributed as dist

from rlhf.agents.trajectory import Termination, TrajectoryBuilder


async def _turns(ctx, sample, num_turns, kept):
    """`num_turns` turns with a user observation between them; the conversation keeps `kept(text)` of each."""
    messages = list(sample.prompt)
    builder = TrajectoryBuilder(prompt=ctx.renderer.prompt(messages), token_budget=ctx.limits.token_budget)
    for turn in range(num_turns):
        generation = await ctx.generate(builder.tokens, 4)
        builder.add_sampled(generation.token_ids, generation.logprobs, generation.policy_version)
        if turn < num_turns - 1:
            messages.append({"role": "assistant", "content": kept(ctx.renderer.tokenizer.decode(generation.token_ids))})
            ctx.advance(builder, messages, [{"role": "user", "content": f"again {turn} r{dist.get_rank()}"}])
    return builder


async def three_turns(ctx, sample):
    return ctx.finish(await _turns(ctx, sample, 3, lambda text: text), Termination.MAX_TURNS, 3)


async def forking(ctx, sample):
    # prompt 0 rewrites its history (as a template dropping old reasoning does): a fork
    builder = await _turns(ctx, sample, 2, lambda text: "[summary]" if sample.index == 0 else text)
    return ctx.finish(builder, Termination.MAX_TURNS, 2, reward=float(sum(builder.tokens) % 3))


async def stepping(ctx, sample):
    """Two turns, each rewarded by its digits mod 3 (per-turn rewards, as an environment gives them)."""
    messages = list(sample.prompt)
    builder = TrajectoryBuilder(prompt=ctx.renderer.prompt(messages), token_budget=ctx.limits.token_budget)
    rewards = []
    for turn in range(2):
        generation = await ctx.generate(builder.tokens, 4)
        builder.add_sampled(generation.token_ids, generation.logprobs, generation.policy_version)
        text = ctx.renderer.tokenizer.decode(generation.token_ids)
        rewards.append(float(sum(c.isdigit() for c in text) % 3))
        if turn == 0:
            messages.append({"role": "assistant", "content": text})
            ctx.advance(builder, messages, [{"role": "user", "content": "step 1"}])
    reward = rewards[0] + ctx.limits.turn_discount * rewards[1]
    return ctx.finish(builder, Termination.MAX_TURNS, 2, reward=reward, turn_rewards=tuple(rewards))
'''


def make_multiturn_setup(root, **dims):
    """A tiny chat model (char tokenizer with a chat template), sum prompts, the agents above, a calculator."""
    shape = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64) | dims
    model = init_hf_model(InitModelConfig(max_position_embeddings=256, **shape), build_chat_char_tokenizer(),
                          root / "model")
    for name, count in (("train", 16), ("val", 4)):
        with open(root / f"{name}.jsonl", "w") as f:
            for i in range(count):
                row = {"prompt": [{"role": "user", "content": f"{i}+{i}"}], "data_source": "tool/sum",
                       "reward_model": {"ground_truth": str(2 * i)}}
                f.write(json.dumps(row) + "\n")
    (root / "agent.py").write_text(AGENT)
    (root / "tools.yaml").write_text("tools:\n  - class_name: calculator\n")
    return {"model": str(model), "train": str(root / "train.jsonl"), "val": str(root / "val.jsonl"),
            "agent": str(root / "agent.py"), "tools": str(root / "tools.yaml")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_multiturn_setup(tmp_path_factory.mktemp("multiturn"))


def multiturn_config(setup, root, overrides):
    from rlhf.config import from_dict
    from rlhf.config.loader import apply_overrides
    from rlhf.orchestration.schema import RlhfConfig

    data = {"dist": {"backend": "gloo", "timeout_s": 120}, "run": {"output_dir": root, "name": "m"},
            "model": {"path": setup["model"]},
            "data": {"train_files": [setup["train"]], "val_files": [setup["val"]], "prompts_per_step": 4,
                     "max_prompt_length": 64},
            "sampling": {"n": 2, "max_new_tokens": 8}, "reward": {"by_source": {"tool/*": "reasoning_gym_exact"}},
            "actor": {"optim": {"lr": 1e-3}, "micro_batch_size": 4, "recompute_old_logprobs": True},
            "rollout": {"native": {"max_batch_size": 16, "max_seq_len": 256}},
            "multiturn": {"enable": True, "limits": {"token_budget": 200}},
            "trainer": {"total_steps": 2, "tensorboard": False, "plot": False}}
    return from_dict(RlhfConfig, apply_overrides(data, overrides))


def fit_run(cfg, trainer_class, **setup_kwargs):
    """One run on this world: its history and the scored batches it trained on."""
    from rlhf.run_dir import close_run, setup_run

    run_dir = setup_run(cfg.run, cfg, **setup_kwargs)
    try:
        trainer = trainer_class(cfg, run_dir)
        batches = []
        trainer.scored_hooks.append(lambda batch, step: batches.append(batch))
        return {"history": trainer.fit(), "batches": batches}
    finally:
        close_run()


def _runs(setup, root):
    import torch.distributed as dist

    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight
    from rlhf.orchestration.replay import Replayer, replay_config, replay_preflight

    out = {}
    agent = f"multiturn.agent={setup['agent']}:three_turns"
    split = ["mesh.placement=split", "mesh.actor={ranks: [0, 1]}", "mesh.rollout={ranks: [1, 2]}"]
    fork = [f"multiturn.agent={setup['agent']}:forking", "multiturn.limits.history=fork", "data.shuffle=false",
            "trainer.total_steps=1", "algo.rollout_correction.enable=true", "sampling.max_new_tokens=64",
            "algo.overlong_buffer.len=60", "multiturn.limits.token_budget=160"]
    for name, overrides in (("agent", [agent]),
                            ("tp2", [agent, "mesh.actor.tp=2", "mesh.rollout.tp=2", "trainer.total_steps=1"]),
                            ("split", [agent, *split, "trainer.total_steps=1"]),
                            ("async", [agent, *split, "trainer.async_mode=one_step_off", "comm.verify=true"]),
                            ("fork", fork + ["trainer.dump_rollouts=true"]),
                            ("fork_dapo", fork + ["algo.filter_groups.enable=true",
                                                  "algo.filter_groups.max_num_gen_batches=3"]),
                            ("turn", [f"multiturn.agent={setup['agent']}:stepping", "multiturn.credit=turn",
                                      "multiturn.limits.turn_discount=0.5", "trainer.total_steps=1",
                                      "trainer.dump_rollouts=true"]),
                            ("tools", ["multiturn.agent=tools", f"multiturn.tool_config={setup['tools']}",
                                       "multiturn.list_tools=false"])):
        cfg = multiturn_config(setup, f"{root}/{name}", overrides)
        preflight(cfg, dist.get_world_size())
        out[name] = fit_run(cfg, Trainer)
    # the fork run's dump replayed (no validation, so no engine): the same update on the same rows
    replay = fork + [f"replay.rollouts={root}/fork/m/rollouts", "data.val_files=[]"]
    cfg = replay_config(multiturn_config(setup, f"{root}/replay", replay))
    replay_preflight(cfg, dist.get_world_size())
    out["replay"] = fit_run(cfg, Replayer, prefix="replay", defer_config=True)
    return out


def test_multiturn_grpo_trains_on_sampled_tokens_only(setup, tmp_path):
    world = run_distributed(_runs, 2, setup, str(tmp_path), timeout_s=600)
    agent, tools, tp2, split = world[0]["agent"], world[0]["tools"], world[0]["tp2"], world[0]["split"]
    for row in agent["history"][1:] + tp2["history"][1:] + split["history"][1:]:  # (row 0: validation first)
        assert row["multiturn/turns_mean"] == 3.0 and row["multiturn/generate_calls"] == 3.0
        assert row["multiturn/prefix_mismatch"] == 0.0 and row["multiturn/termination/max_turns"] == 1.0
        assert row["rollout/logprob_diff_max"] <= 1e-5  # the trainer's recompute across interior zeros
    assert len(tp2["history"]) == 2 and "val/score/mean@1" in tp2["history"][0]
    one_off = world[0]["async"]
    assert [row["step"] for row in one_off["history"]] == [0, 1, 2]
    for row in one_off["history"][1:]:
        assert row["multiturn/turns_mean"] == 3.0 and row["multiturn/prefix_mismatch"] == 0.0
    for batch in one_off["batches"]:  # both batches sampled before the first update landed (one step off)
        assert set(batch.policy_version_bt[batch.loss_mask_bt].tolist()) == {0}
    tokenizer = build_chat_char_tokenizer()
    (tp2_batch,) = tp2["batches"]
    texts = [tokenizer.decode(row.tolist()) for row in tp2_batch.tokens_bs]
    assert all("again 0 r0" in text and "again 1 r0" in text and " r1" not in text for text in texts)
    for batch in agent["batches"] + tp2["batches"] + split["batches"] + one_off["batches"]:
        assert batch.size == 8  # 4 prompts x 2 samples: one row per trajectory
        sampled_b = batch.loss_mask_bt.sum(-1)
        assert (sampled_b <= 12).all() and (sampled_b < batch.response_lengths_b).all()  # user turns are zeros
        assert torch.equal(batch.response_mask_bt, batch.loss_mask_bt)
        assert torch.equal(batch.rollout_logprobs_bt != 0, batch.loss_mask_bt)
        assert ((batch.advantages_bt != 0) <= batch.loss_mask_bt).all()
    assert "val/score/mean@1" in agent["history"][0]
    _check_forks(world[0]["fork"])
    _check_fork_dapo(world[0]["fork_dapo"])
    _check_turn_credit(world[0]["turn"], f"{tmp_path}/turn/m/rollouts/step_000001.parquet")
    _check_replay(world[0]["fork"], world[0]["replay"], f"{tmp_path}/fork/m/rollouts/step_000001.parquet")
    for row in tools["history"][1:]:
        assert row["multiturn/dropped_groups"] == 0.0 and "multiturn/engine_idle_share" in row


def _check_forks(fork):
    """Prompt 0's two trajectories forked into two rows each (10 rows, padded to 16 with empty rows); each
    trajectory's rows share one GRPO advantage, computed over the group's trajectories, not its rows."""
    from rlhf.algo.advantages import AdvantageInputs, compute_advantages, scores_to_token_rewards
    from rlhf.algo.config import AdvantageConfig
    from rlhf.algo.groups import Groups

    row = fork["history"][1]
    assert row["multiturn/forks_mean"] == 0.25 and row["multiturn/prefix_mismatch"] == 2.0
    assert row["rollout/logprob_diff_max"] <= 1e-5
    (batch,) = fork["batches"]
    real_b = batch.loss_mask_bt.any(-1)
    assert batch.size == 16 and int(real_b.sum()) == 10 and not batch.response_mask_bt[~real_b].any()
    assert batch.group_index_b[:4].tolist() == [0, 0, 0, 0] and batch.trajectory_index_b[:4].tolist() == [0, 0, 1, 1]
    first_b = batch.loss_mask_bt.int().argmax(-1, keepdim=True)
    advantage_b = batch.advantages_bt.gather(1, first_b).squeeze(1)
    assert advantage_b[0] == advantage_b[1] and advantage_b[2] == advantage_b[3]
    assert batch.scores_b[0] == batch.scores_b[1] and batch.scores_b[2] == batch.scores_b[3]
    own = [0, 2] + list(range(4, 10))  # one row per trajectory, as GRPO sees them
    mask = batch.response_mask_bt[own]
    expected = compute_advantages(AdvantageConfig(kind="grpo"), AdvantageInputs(
        token_rewards_bt=scores_to_token_rewards(batch.scores_b[own], mask), response_mask_bt=mask,
        groups=Groups.from_index(batch.group_index_b[own]))).advantages_bt[:, 0]
    assert torch.equal(advantage_b[[0, 2] + list(range(4, 10))], expected) and expected.abs().sum() > 0
    assert not batch.advantages_bt[~real_b].any()
    # overlong shaping reads the whole trajectory (both rows: 4 sampled + observation tokens each), so the rows
    # of one trajectory share a penalty; the agent's reward is an integer, the penalty -(total - 4) / 60
    total_b = batch.trajectory_lengths_b[:10]
    assert total_b[0] == batch.response_lengths_b[:2].sum() and batch.response_lengths_b[0] != total_b[0]
    reward_b = batch.scores_b[:10] + (total_b - 4).clamp(min=0) / 60
    torch.testing.assert_close(reward_b, reward_b.round())
    # the 6 padding rows are marked and left out of the batch's metrics
    assert batch.sample_index_b[10:].tolist() == [-1] * 6 and batch.sample_index_b[:10].min() >= 0
    assert row["response_length/mean"] == pytest.approx(float(batch.response_lengths_b[:10].float().mean()))
    assert row["critic/score/mean"] == pytest.approx(float(batch.scores_b[:10].mean()))


def _check_fork_dapo(run):
    """Dynamic sampling over forked trajectories: the kept groups are the ones whose trajectories' scores differ
    (every row of a trajectory carries its score), whole, with every row of each trajectory; the multi-turn
    metrics cover every generation round."""
    row, (batch,) = run["history"][1], run["batches"]
    # multiturn/* count every round's trajectories: two turns, so two batched calls a round on each replica
    assert row["multiturn/generate_calls"] == 2 * row["dynamic_sampling/gen_rounds"] and row["multiturn/forks_mean"] > 0
    real_b = batch.sample_index_b >= 0
    assert batch.size % 8 == 0 and batch.group_index_b[real_b].unique().numel() == 4
    for group in batch.group_index_b[real_b].unique().tolist():
        rows_b = real_b & (batch.group_index_b == group)
        per_trajectory = {}
        for trajectory, score in zip(batch.trajectory_index_b[rows_b].tolist(), batch.scores_b[rows_b].tolist()):
            per_trajectory.setdefault(trajectory, set()).add(score)
        assert sorted(per_trajectory) == [0, 1] and all(len(scores) == 1 for scores in per_trajectory.values())
        kept = row["dynamic_sampling/kept_groups"]
        if group < kept:  # the informative ones come first; a short step is filled with uninformative groups
            assert len(set().union(*per_trajectory.values())) == 2


def _check_turn_credit(run, dump):
    """`credit=turn`: each turn's tokens carry its return-to-go (the environment's per-turn rewards, gamma 0.5),
    the advantages are GRPO per (prompt, turn), and the dump holds the returns."""
    from rlhf.algo.advantage_base import AdvantageInputs
    from rlhf.algo.config import AdvantageConfig
    from rlhf.algo.groups import Groups
    from rlhf.algo.turn_credit import turn_advantages, turn_numbers_bt
    from rlhf.orchestration.rollout_dump import read_dump

    (batch,), tokenizer = run["batches"], build_chat_char_tokenizer()
    turns_bt = turn_numbers_bt(batch.loss_mask_bt, Groups.from_index(torch.arange(batch.size)))
    assert int(turns_bt.max()) == 2
    for row in range(batch.size):
        rewards = []
        for turn in (1, 2):
            cols = (turns_bt[row] == turn).nonzero().squeeze(1)
            ids = batch.tokens_bs[row, batch.prompt_lengths_b[row] + cols].tolist()
            rewards.append(sum(c.isdigit() for c in tokenizer.decode(ids)) % 3)
        expected = {1: rewards[0] + 0.5 * rewards[1], 2: rewards[1]}
        for col in batch.loss_mask_bt[row].nonzero().squeeze(1).tolist():
            assert batch.turn_returns_bt[row, col] == expected[int(turns_bt[row, col])]
        assert batch.scores_b[row] == expected[1]  # the trajectory's score: the whole discounted return
    inputs = AdvantageInputs(token_rewards_bt=torch.zeros(batch.response_mask_bt.shape),
                             response_mask_bt=batch.response_mask_bt, groups=Groups.from_index(batch.group_index_b))
    expected_bt = turn_advantages(AdvantageConfig(kind="grpo"), inputs, batch.turn_returns_bt, None).advantages_bt
    assert torch.equal(batch.advantages_bt, expected_bt) and expected_bt.abs().sum() > 0
    back = read_dump(dump, vocab_size=len(tokenizer), max_positions=256)
    assert torch.equal(back.turn_returns_bt, batch.turn_returns_bt[:, :back.response_width])


def _check_replay(fork, replay, dump):
    """The dump holds the loss mask with its interior zeros and the trajectories; replay trains on it exactly."""
    import pyarrow.parquet as pq

    (batch,), (replayed,) = fork["batches"], replay["batches"]
    table = pq.read_table(dump).to_pydict()
    assert len(table["loss_mask"]) == 16 and table["trajectory"][:4] == [0, 0, 1, 1]
    assert table["uid"][10:] == [-1] * 6 and table["data_source"][10:] == [""] * 6  # the padding rows
    for row, mask in enumerate(table["loss_mask"]):
        assert mask == batch.response_mask_bt[row, :int(batch.response_lengths_b[row])].tolist()
    assert any(False in mask[mask.index(True):] for mask in table["loss_mask"] if True in mask)  # interior zeros
    for name in ("tokens_bs", "response_mask_bt", "loss_mask_bt", "trajectory_index_b", "group_index_b",
                 "scores_b", "advantages_bt", "rollout_logprobs_bt", "policy_version_bt"):
        assert torch.equal(getattr(batch, name), getattr(replayed, name)), name
    ours, theirs = fork["history"][1], replay["history"][-1]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout_corr/is_weight_mean"):
        assert abs(ours[key] - theirs[key]) <= 1e-6 * max(1.0, abs(ours[key])), (key, ours[key], theirs[key])


def test_multiturn_refusals(setup, tmp_path):
    from rlhf.orchestration.preflight import preflight

    tools = ["multiturn.agent=tools", f"multiturn.tool_config={setup['tools']}"]
    cfg = multiturn_config(setup, str(tmp_path), tools + ["multiturn.limits.history=fork",
                                                          "algo.advantage.kind=reinforce_plus_plus"])
    with pytest.raises(ConfigError, match=r"^multiturn\.limits\.history=fork gives a trajectory several rows, which "
                                          r"algo\.advantage\.kind=reinforce_plus_plus cannot score as one; use one "
                                          r"of grpo, rloo, gpg, grpo_passk or multiturn\.limits\.history=append$"):
        preflight(cfg, world_size=1)
    preflight(multiturn_config(setup, str(tmp_path), tools + ["sampling.max_new_tokens=64"]), world_size=1)
    cfg = multiturn_config(setup, str(tmp_path), tools + ["multiturn.limits.token_budget=300"])
    with pytest.raises(ConfigError, match=r"^a multi-turn row holds up to multiturn\.limits\.token_budget=300 "
                                          r"tokens, but a KV-cache slot holds rollout\.native\.max_seq_len=256; "
                                          r"raise max_seq_len to 300 or lower token_budget$"):
        preflight(cfg, world_size=1)
    cfg = multiturn_config(setup, str(tmp_path), tools + ["multiturn.credit=turn", "algo.advantage.kind=gae"])
    with pytest.raises(ConfigError, match=r"^multiturn\.credit=turn does not run with algo\.advantage\.kind=gae: its "
                                          r"turns are scored on the rollout side; use one of grpo, rloo, gpg, "
                                          r"grpo_passk or multiturn\.credit=trajectory$"):
        preflight(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"^multiturn\.credit='step': use 'trajectory' \(one score per trajectory\) "
                                          r"or 'turn' \(each turn scored by its discounted return-to-go\)$"):
        multiturn_config(setup, str(tmp_path), tools + ["multiturn.credit=step"])
    cfg = multiturn_config(setup, str(tmp_path), tools + [
        "mesh.placement=split", "mesh.actor={ranks: [0, 1]}", "mesh.rollout={ranks: [1, 2]}",
        "trainer.async_mode=one_step_off", "trainer.max_staleness=2", "trainer.partial_rollout_tokens=2"])
    with pytest.raises(ConfigError, match=r"^multiturn\.enable=true does not run with trainer\."
                                          r"partial_rollout_tokens=2 \(a turn is not continued across a weight "
                                          r"push\) yet; use trainer\.partial_rollout_tokens=0$"):
        preflight(cfg, world_size=2)
    cfg = multiturn_config(setup, str(tmp_path), ["multiturn.agent=tools",
                                                  f"multiturn.tool_config={tmp_path}/none.yaml"])
    with pytest.raises(ConfigError, match=rf"^tool config {tmp_path}/none\.yaml does not exist; point "
                                          r"multiturn\.tool_config at a YAML file with a `tools:` list$"):
        preflight(cfg, world_size=1)

"""The RL trainer end to end on real gloo ranks: GRPO and PPO over TP/DP and split placement, exact resume."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer  # noqa: E402

from rlhf.metrics import read_jsonl  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"))


def _four_rank_runs(paths, root, reward_model):
    grpo = run_trainer(paths, f"{root}/grpo", [
        "mesh.actor.tp=2", "mesh.rollout.tp=2", "mesh.ref.tp=2", "algo.kl.coef=0.01", "run.name=grpo",
        "trainer.plot=true", "ref.micro_batch_size=2"])
    ppo = run_trainer(paths, f"{root}/ppo", [
        "mesh.placement=split", "mesh.actor={tp: 2, ranks: [0, 2]}", "mesh.rollout={tp: 2, ranks: [0, 2]}",
        "mesh.critic={ranks: [2, 4]}", "algo.advantage.kind=gae", "algo.advantage.lam=0.95",
        "algo.kl.coef=0.05", "algo.kl.in_reward=true", "mesh.ref={tp: 1, ranks: [0, 2]}", "run.name=ppo",
        "sampling.temperature=0.7",  # training logprobs at the sampling temperature match the rollout's
        "actor.epochs=2", "actor.mini_batches=2",
        "comm.strategy=plain"])  # metrics and the split-placement weight sync without buckets
    rm = run_trainer(paths, f"{root}/rm", [
        "mesh.placement=split", "mesh.actor={ranks: [0, 2]}", "mesh.rollout={ranks: [0, 2]}",
        "mesh.reward={tp: 2, ranks: [2, 4]}", f"reward.model_path={reward_model}", "run.name=rm",
        "reward.model_micro_batch_size=3"])
    remax = run_trainer(paths, f"{root}/remax", ["mesh.actor.tp=2", "mesh.rollout.tp=2", "run.name=remax",
                                                 "algo.advantage.kind=remax", "trainer.total_steps=1",
                                                 "trainer.val_before_train=false"])
    return grpo, ppo, rm, remax


def test_grpo_tp2_dp2_and_ppo_split_placement_on_4_ranks(tiny, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    rm_config = AutoConfig.from_pretrained(tiny["model"], num_labels=1, pad_token_id=0)
    AutoModelForSequenceClassification.from_config(rm_config).float().save_pretrained(tmp_path / "reward_model")
    results = run_distributed(_four_rank_runs, 4, tiny, str(tmp_path), str(tmp_path / "reward_model"),
                              timeout_s=400)
    grpo, ppo, rm, remax = results[0]
    assert results[1] == results[0], "every rank sees the same reduced metrics"
    assert [row["step"] for row in grpo] == [0, 1, 2]
    for row in grpo[1:] + ppo[1:]:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean",
                    "response_length/mean", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor",
                    "perf/throughput_tok_s", "rollout/logprob_diff_max"):
            assert key in row and math.isfinite(row[key]), (key, row)
        assert row["rollout/logprob_diff_max"] < 1e-4, "rollout and training forward must agree"
    assert "actor/kl_loss" in grpo[1] and "timing_s/ref" in grpo[1]
    assert grpo[1]["actor/kl_coef"] == 0.01, "a constant, not summed over micro-batches"
    for key in ("critic/vf_loss", "critic/vf_explained_var", "timing_s/values", "timing_s/update_critic",
                "actor/reward_kl_penalty"):
        assert key in ppo[1], key
    assert "val/score/mean@1" in grpo[-1]
    # A reward model on its own ranks (2-3, tp2) scores the rollouts made on ranks 0-1; validation keeps the rule.
    assert "timing_s/reward" in rm[1] and rm[1]["critic/score/max"] != rm[1]["critic/score/min"]
    assert "val/score/mean@1" in rm[-1]
    assert math.isfinite(remax[-1]["actor/pg_loss"]), "ReMax's greedy baseline runs on every TP rank"
    logged = read_jsonl(tmp_path / "grpo/grpo/metrics.jsonl")
    assert [row["step"] for row in logged] == [0, 1, 2]
    assert (tmp_path / "grpo/grpo/curve.png").stat().st_size > 1000, "trainer.plot draws every run's curve"
    assert not (tmp_path / "ppo/ppo/curve.png").exists()
    assert (tmp_path / "ppo/ppo/checkpoints/step_2/manifest.json").is_file()


def _resume_runs(paths, root):
    from pathlib import Path

    from rlhf.orchestration.export import export_checkpoint

    full = run_trainer(paths, f"{root}/full", ["trainer.total_steps=6", "checkpoint.every=3", "run.name=r"])
    run_trainer(paths, f"{root}/split", ["trainer.total_steps=3", "checkpoint.every=3", "run.name=r"])
    resumed = run_trainer(paths, f"{root}/split", ["trainer.total_steps=6", "checkpoint.every=3", "run.name=r"])
    import torch.distributed as dist

    if dist.get_rank() == 0:  # one process merges the 2-rank checkpoint
        export_checkpoint(f"{root}/full/r/checkpoints/step_6", f"{root}/exported", tokenizer_dir=paths["model"])
    dist.barrier()
    length_reward = Path(root) / "length_reward.py"  # a dense signal, so the update really moves the weights
    length_reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                             "    return float(len(solution) % 2)\n")
    resharded = run_trainer(paths, f"{root}/reshard", ["mesh.actor.tp=2", "mesh.rollout.tp=1", "run.name=x",
                                                       "actor.optim.lr=0.05", "comm.verify=true",
                                                       "trainer.total_steps=3", "reward.by_source={}",
                                                       f"reward.function={length_reward}:score"])
    others = {kind: run_trainer(paths, f"{root}/{kind}", [f"algo.advantage.kind={kind}", "run.name=k",
                                                          "trainer.total_steps=1", "trainer.val_before_train=false",
                                                          "reward.by_source={}",
                                                          f"reward.function={length_reward}:score"])
              for kind in ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")}
    return full, resumed, resharded, others


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/throughput", "memory/"))}


def test_resume_export_reshard_and_every_estimator(tiny, tmp_path):
    full, resumed, resharded, others = run_distributed(_resume_runs, 2, tiny, str(tmp_path), timeout_s=500)[0]
    assert [row["step"] for row in resumed] == [4, 5, 6]
    assert [_comparable(r) for r in full[4:]] == [_comparable(r) for r in resumed]
    assert sorted(p.name for p in (tmp_path / "split/r/checkpoints").iterdir()) == ["latest", "step_3", "step_6"]
    # The export loads in transformers and holds the trained (not the initial) weights, bit for bit.
    import torch
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny["model"]).state_dict()
    from rlhf.checkpoint import read_manifest, tensor_folders

    step = tmp_path / "full/r/checkpoints/step_6"
    key = "model.layers.1.mlp.down_proj.weight"
    trained = tensor_folders(step, read_manifest(step), "actor")("model").slice(key)[:]  # stored once, full
    assert not torch.equal(exported[key], initial[key])  # weight decay moved it even at zero advantage
    assert torch.equal(exported[key], trained)
    # Actor tp2 -> rollout tp1 x dp2 goes through the planned resharding: after updates (a large lr moves the
    # weights), the rollout engine still samples with exactly the actor's weights.
    assert all(row["rollout/logprob_diff_max"] < 1e-4 for row in resharded[1:])
    assert resharded[-1]["actor/grad_norm"] > 0
    # The other estimators run end to end too (ReMax also generates a greedy baseline per prompt).
    for kind, history in others.items():
        assert history[-1]["actor/grad_norm"] > 0 and math.isfinite(history[-1]["actor/pg_loss"]), kind


def test_reward_function_raising_names_the_sample_and_saves_nothing(tiny, tmp_path):
    reward = tmp_path / "bad_reward.py"
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    raise ValueError('grader crashed')\n")
    from rlhf.testing.distributed import DistributedTestError

    with pytest.raises(DistributedTestError, match=r"RewardError: reward for sample 0 \(index \d+, data_source "
                                                   r"'reasoning_gym/chain_sum'\) raised ValueError: grader crashed"):
        run_distributed(run_trainer, 2, tiny, str(tmp_path), [f"reward.function={reward}:score",
                                                              "reward.by_source={}"], timeout_s=200)
    assert not (tmp_path / "t" / "checkpoints").exists()


@pytest.mark.slow  # the default suite has the directly launched stall (tests/orchestration/test_stall.py)
def test_a_hung_step_ends_every_rank_with_stacks_in_the_logs(tiny, tmp_path):
    reward = tmp_path / "slow_reward.py"
    reward.write_text("import os, time\n"
                      "def score(data_source, solution, ground_truth, extra_info):\n"
                      "    if os.environ['RANK'] == '0':\n"
                      "        time.sleep(600)\n"
                      "    return 0.0\n")
    from rlhf.testing.distributed import DistributedTestError

    with pytest.raises(DistributedTestError, match="exit code 124"):
        run_distributed(run_trainer, 2, tiny, str(tmp_path), [f"reward.function={reward}:score", "reward.by_source={}",
                                                              "comm.step_timeout_s=8", "trainer.val_before_train=false"],
                        timeout_s=200)
    for rank in (0, 1):
        log = (tmp_path / "t" / f"rank{rank}.log").read_text()
        assert "rl_step 1" in log and "Thread" in log, log[-2000:]
    assert "slow_reward.py" in (tmp_path / "t" / "rank0.log").read_text()

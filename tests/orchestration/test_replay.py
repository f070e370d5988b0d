"""`rlhf replay` on real gloo ranks: a run dumps its rollouts; replaying its own dumps with the same seed
reproduces its updates and its validation; reward normalisation resumes exactly; logged generations and
per-source validation metrics come out as text and scalars."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402

from rlhf.metrics import read_jsonl  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402

# What must not differ between a run and the replay of its dumps (timings, throughput and memory do).
UPDATE_PREFIXES = ("actor/", "critic/", "rollout_corr/", "rollout/", "response_length/", "prompt_length/")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_val=4)


def _replay(paths, root, overrides):
    """A replay run on this world (as `rlhf replay` runs it); returns its history and whether it built an engine."""
    import torch.distributed as dist

    from rlhf.run_dir import close_run, setup_run
    from rlhf.orchestration.replay import Replayer, replay_config, replay_preflight

    cfg = replay_config(trainer_config(paths, root, overrides))
    replay_preflight(cfg, dist.get_world_size())
    run_dir = setup_run(cfg.run, cfg, prefix="replay", defer_config=True)
    try:
        replayer = Replayer(cfg, run_dir)
        return {"history": replayer.fit(), "engine": replayer.rollout_side.engine is not None}
    finally:
        close_run()


def _runs(paths, root):
    from fixtures import run_trainer

    reward = Path(root) / "length_reward.py"  # a dense signal, so the updates move the weights
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    other = Path(root) / "val_other.jsonl"  # a second data source in validation: 2 prompts, listed first
    rows = [json.loads(line) for line in open(paths["val"])][:2]
    other.write_text("".join(json.dumps({**row, "data_source": "other/src"}) + "\n" for row in rows))
    common = ["reward.by_source={}", f"reward.function={reward}:score", "actor.optim.lr=0.05", "algo.kl.coef=0.01",
              "algo.rollout_correction.enable=true", "trainer.total_steps=3", "trainer.val_samples=3",
              "sampling.val_n=2", "sampling.val_temperature=1.0", f"data.val_files=[{other},{paths['val']}]"]
    original = run_trainer(paths, f"{root}/orig", common + ["run.name=o", "trainer.dump_rollouts=true"])
    dumps = f"{root}/orig/o/rollouts"
    same = _replay(paths, f"{root}/replay", common + ["run.name=r", f"replay.rollouts={dumps}",
                                                      "trainer.dump_rollouts=true"])
    # Reward normalisation at another learning rate, no validation (no engine built), stopped at step 2 and
    # resumed = uninterrupted.
    norm = common + ["replay.reward_norm=true", "data.val_files=[]", f"replay.rollouts={dumps}", "checkpoint.every=2",
                     "actor.optim.lr=0.01"]
    full = _replay(paths, f"{root}/norm", norm + ["run.name=n"])
    _replay(paths, f"{root}/norm_split", norm + ["run.name=n", "trainer.total_steps=2"])
    resumed = _replay(paths, f"{root}/norm_split", norm + ["run.name=n"])
    return original, same, full, resumed


def _close(a, b):
    return abs(a - b) <= 1e-6 * max(1.0, abs(a))


def test_replaying_a_runs_own_dumps_reproduces_its_updates(tiny, tmp_path):
    import pyarrow.parquet as pq
    import torch

    from rlhf.data.char_tokenizer import build_char_tokenizer

    original, same, full, resumed = run_distributed(_runs, 2, tiny, str(tmp_path), timeout_s=600)[0]
    # The dumps: one file per step, one row per rollout, ids and text that agree, the run's own scores.
    files = sorted((tmp_path / "orig/o/rollouts").iterdir())
    assert [f.name for f in files] == ["step_000001.parquet", "step_000002.parquet", "step_000003.parquet"]
    tokenizer = build_char_tokenizer()
    for step, path in enumerate(files, start=1):
        rows = pq.read_table(path).to_pylist()
        assert len(rows) == 4 * 4 and {row["step"] for row in rows} == {step}
        assert {v for row in rows for v in row["policy_version"]} == {step - 1}
        assert {row["data_source"] for row in rows} == {"reasoning_gym/chain_sum"}
        assert sorted({row["group"] for row in rows}) == [0, 1, 2, 3]
        for row in rows:
            assert row["response"] == tokenizer.decode(row["response_ids"], skip_special_tokens=True)
            assert row["score"] == float(len(row["response"]) % 2)
            assert len(row["rollout_logprobs"]) == len(row["advantages"]) == len(row["response_ids"])
        mean = torch.tensor([row["score"] for row in rows]).mean().item()
        assert abs(original[step]["critic/score/mean"] - mean) < 1e-6
    assert not (tmp_path / "replay/r/rollouts").exists(), "a replay dumps nothing again"
    # Replay of the run's own dumps, same seed: every step's update and the validations are the run's.
    assert [row["step"] for row in same["history"]] == [0, 1, 2, 3] and same["engine"]
    for ours, theirs in zip(original[1:], same["history"][1:]):
        keys = [key for key in ours if key.startswith(UPDATE_PREFIXES)]
        assert {"actor/pg_loss", "actor/grad_norm", "rollout_corr/is_weight_mean", "actor/kl_loss"} <= set(keys)
        for key in keys:
            assert _close(ours[key], theirs[key]), (key, ours[key], theirs[key])
        assert "timing_s/gen" not in theirs and "timing_s/load" in theirs
        assert theirs["replay/raw_score/mean"] == theirs["critic/score/mean"]
    sources = ("val/other/src/score/mean@2", "val/reasoning_gym/chain_sum/score/mean@2")
    for key in ("val/score/mean@1", "val/score/mean@2", "val/reasoning_gym/chain_sum/score/pass@2") + sources:
        assert original[-1][key] == same["history"][-1][key], key
    for row in (original[0], original[-1]):  # per-source means weigh up to the overall one (2 + 4 prompts)
        assert _close(row["val/score/mean@2"], (2 * row[sources[0]] + 4 * row[sources[1]]) / 6)
    # Reward normalisation scales every step's scores by the running std; the resumed replay is exact.
    assert not full["engine"] and [row["step"] for row in full["history"]] == [1, 2, 3]
    for row in full["history"]:
        assert row["replay/reward_std"] > 0
        assert _close(row["critic/score/mean"], row["replay/raw_score/mean"] / row["replay/reward_std"]), row
    # Another learning rate, other updates: from step 2 on the policy is not the one that sampled the dumps, and
    # the importance weights correct for it.
    assert full["history"][1]["rollout/logprob_diff_max"] > 1e-3 > same["history"][2]["rollout/logprob_diff_max"]
    assert full["history"][1]["rollout_corr/is_weight_max"] > 1 + 1e-3
    assert [row["step"] for row in resumed["history"]] == [3]
    comparable = {k: v for k, v in full["history"][-1].items() if not k.startswith(("timing_s/", "perf/", "memory/"))}
    assert comparable == {k: resumed["history"][-1][k] for k in comparable}
    # Validation generations as text: samples.jsonl (val_samples=3 per validation), steps 0 and 3.
    samples = read_jsonl(tmp_path / "orig/o/samples.jsonl")
    assert [(s["step"], s["index"]) for s in samples] == [(0, 0), (0, 1), (0, 2), (3, 0), (3, 1), (3, 2)]
    val = [json.loads(line) for line in open(tiny["val"])]
    for sample in samples:
        assert sample["data_source"] == ("other/src" if sample["index"] < 2 else "reasoning_gym/chain_sum")
        truth = val[sample["index"] % 2 if sample["index"] < 2 else sample["index"] - 2]["reward_model"]["ground_truth"]
        assert sample["ground_truth"] == str(truth) and sample["prompt"].endswith("=")
        assert sample["score"] == float(len(sample["response"]) % 2)


def test_replay_needs_rollouts_and_turns_auto_correction_on(tiny, tmp_path):
    from rlhf.errors import ConfigError
    from rlhf.orchestration.replay import replay_config

    with pytest.raises(ConfigError, match=r"^rlhf replay needs the dumps to train on: --rollouts DIR \(a run's "
                                          r"rollouts/ folder\)$"):
        replay_config(trainer_config(tiny, str(tmp_path)))
    cfg = replay_config(trainer_config(tiny, str(tmp_path), ["replay.rollouts=x", "trainer.dump_rollouts=true"]))
    assert cfg.algo.rollout_correction.enable is True and cfg.trainer.dump_rollouts is False
    kept = replay_config(trainer_config(tiny, str(tmp_path), ["replay.rollouts=x", "algo.rollout_correction.enable=false"]))
    assert kept.algo.rollout_correction.enable is False

"""Bad input to `rlhf train` fails before anything is written, with a one-line error naming the value."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402

from rlhf.errors import ConfigError, DataError  # noqa: E402
from rlhf.trainer.loop import preflight  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=16, num_val=4)


def test_inconsistent_batch_sizes(tiny, tmp_path):
    cfg = trainer_config(tiny, str(tmp_path), ["actor.micro_batch_size=3"])
    with pytest.raises(ConfigError, match=r"^actor: 16 rollouts per step \(data\.prompts_per_step=4 x sampling\.n=4\) "
                                          r"must split into actor\.mini_batches=1 x dp=2 x micro-batches of "
                                          r"actor\.micro_batch_size=3"):
        preflight(cfg, world_size=2)
    cfg = trainer_config(tiny, str(tmp_path), ["data.prompts_per_step=3"])
    with pytest.raises(ConfigError, match=r"^data\.prompts_per_step=3 is not divisible by the rollout dp size 2"):
        preflight(cfg, world_size=2)
    cfg = trainer_config(tiny, str(tmp_path), ["sampling.n=1", "actor.micro_batch_size=2"])
    with pytest.raises(ConfigError, match=r"^algo\.advantage\.kind=grpo compares the samples of one prompt"):
        preflight(cfg, world_size=2)


def test_missing_model_and_ground_truth_and_long_prompt(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.path='/nope' is not a folder"):
        preflight(trainer_config(tiny, str(tmp_path), ["model.path=/nope"]), world_size=1)
    rows = [json.loads(line) for line in Path(tiny["train"]).read_text().splitlines()]
    del rows[2]["reward_model"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"bad\.jsonl:3"):
        preflight(trainer_config(tiny, str(tmp_path), [f"data.train_files=[{bad}]"]), world_size=1)
    bad.write_text(Path(tiny["train"]).read_text() + "{not json\n")
    with pytest.raises(DataError, match=rf"bad\.jsonl:{len(rows) + 1}"):
        preflight(trainer_config(tiny, str(tmp_path), [f"data.train_files=[{bad}]"]), world_size=1)
    with pytest.raises(DataError, match=r"> data\.max_prompt_length=2; raise the limit"):
        preflight(trainer_config(tiny, str(tmp_path), ["data.max_prompt_length=2"]), world_size=1)


def test_unknown_reward_source_and_algorithm(tiny, tmp_path):
    rows = [json.loads(line) for line in Path(tiny["train"]).read_text().splitlines()]
    rows[5]["data_source"] = "mystery"
    odd = tmp_path / "odd.jsonl"
    odd.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ConfigError, match=r"^no reward function for data_source 'mystery'; map it in reward\.by_source"):
        preflight(trainer_config(tiny, str(tmp_path), [f"data.train_files=[{odd}]"]), world_size=1)
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'ppo2' \(did you mean 'ppo'\?\); "
                                          r"choose one of: gae, grpo"):
        trainer_config(tiny, str(tmp_path), ["algo.advantage.kind=ppo2"])


def test_reward_model_conflicts(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"^algo\.advantage\.kind=remax scores a greedy baseline with rule rewards"):
        preflight(trainer_config(tiny, str(tmp_path), ["algo.advantage.kind=remax",
                                                       f"reward.model_path={tiny['model']}"]), world_size=1)
    with pytest.raises(ConfigError, match=r"^reward\.model_path='/nope' is not a folder"):
        preflight(trainer_config(tiny, str(tmp_path), ["reward.model_path=/nope"]), world_size=1)


def test_cli_one_line_error_and_nothing_written(tiny, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tiny['model']}}}\ndata: {{train_files: [{tiny['train']}], prompts_per_step: 4}}\n"
                   f"run: {{output_dir: {tmp_path / 'runs'}}}\nactor: {{micro_batch_size: 3}}\n"
                   "dist: {backend: gloo}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "rlhf", "train", "--config", str(cfg)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("rlhf train: error: actor: 16 rollouts per step")
    assert not (tmp_path / "runs").exists()


def test_dropping_weights_the_engine_shares_with_the_actor(tiny, tmp_path):
    cfg = trainer_config(tiny, str(tmp_path), ["rollout.sleep=kv_cache_and_weights"])
    with pytest.raises(ConfigError, match=r"^rollout\.sleep=kv_cache_and_weights would free the weights the native "
                                          r"engine shares with the actor \(same layout\)"):
        preflight(cfg, world_size=2)
    preflight(trainer_config(tiny, str(tmp_path), ["rollout.sleep=kv_cache_and_weights", "mesh.actor.tp=2",
                                                   "mesh.rollout.tp=1"]), world_size=2)


def test_dynamic_sampling_with_a_reward_model_and_bad_rollout_dtype(tiny, tmp_path):
    cfg = trainer_config(tiny, str(tmp_path), ["algo.filter_groups.enable=true", f"reward.model_path={tiny['model']}"])
    with pytest.raises(ConfigError, match=r"^algo\.filter_groups\.enable=true filters groups on rule rewards before "
                                          r"training; it cannot be combined with reward\.model_path yet$"):
        preflight(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"^rollout\.dtype='float16' is not one of 'auto', 'float32', 'bfloat16'$"):
        trainer_config(tiny, str(tmp_path), ["rollout.dtype=float16"])
    with pytest.raises(ConfigError, match=r"^algo\.rollout_correction\.bypass_mode=true anchors PPO"):
        trainer_config(tiny, str(tmp_path), ["algo.rollout_correction.bypass_mode=true"])

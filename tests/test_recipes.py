"""configs/recipes/: every recipe loads and has a run script; each runs one RL step at tiny scale, so none rots
(one 2-rank launch for GRPO / PPO / reward model / multi-node; split placement's 8-rank launch is slow-marked).

The data is a gsm8k-style file in verl's schema (chat-message prompts, data_source openai/gsm8k, the number as
ground truth) read by the built-in gsm8k reward; the model a tiny char-level Llama whose alphabet covers it."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from rlhf.config import load_config
from rlhf.orchestration.schema import RlhfConfig
from rlhf.testing.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "configs" / "recipes"
NAMES = ("agent_smollm2_calculator", "grpo_smollm2_gsm8k", "multi_node", "ppo_critic", "reward_model", "split_8rank")
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-=#?.,"
NO_WARMUP = ["actor.optim.warmup_steps=0", "critic.optim.warmup_steps=0"]  # warmup must fit in the 1-step run


def test_every_recipe_loads_and_has_its_run_script():
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(NAMES)
    for name in NAMES:
        cfg = load_config(RlhfConfig, RECIPES / f"{name}.yaml", ["model.path=/models/policy"])
        assert cfg.run.name and cfg.trainer.total_steps > 1
        script = RECIPES / f"{name}.sh"
        assert f"configs/recipes/{name}.yaml" in script.read_text()
        subprocess.run(["bash", "-n", str(script)], check=True)
        usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
        assert usage.returncode != 0 and "usage: " in usage.stderr  # no arguments: the usage line, nothing runs
    assert load_config(RlhfConfig, RECIPES / "split_8rank.yaml").mesh.placement == "split"


def _gsm8k_style_file(path: Path, num_rows: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"tom has {a} apples and gets {b} more. how many? "}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": "train", "index": i}}
            for i, (a, b) in enumerate((i % 7 + 1, i % 5 + 2) for i in range(num_rows))]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _tiny_setup(root: Path) -> dict[str, str]:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    dims = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                max_position_embeddings=128)
    model = init_hf_model(InitModelConfig(**dims), build_char_tokenizer(ALPHABET), root / "model")
    rm_config = AutoConfig.from_pretrained(model, num_labels=1, pad_token_id=0)
    AutoModelForSequenceClassification.from_config(rm_config).float().save_pretrained(root / "reward_model")
    return {"model": str(model), "reward_model": str(root / "reward_model"),
            "train": _gsm8k_style_file(root / "train.parquet", 48), "val": _gsm8k_style_file(root / "val.parquet", 4)}


def _one_step(paths: dict[str, str], root: str, name: str, extra: list[str]) -> list[dict]:
    import torch.distributed as dist

    from rlhf.run_dir import close_run, setup_run
    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight

    tiny = [f"model.path={paths['model']}", f"data.train_files={paths['train']}", f"data.val_files={paths['val']}",
            f"run.output_dir={root}", "trainer.total_steps=1", "trainer.tensorboard=false", "dist.timeout_s=120",
            "data.max_prompt_length=64", "sampling.max_new_tokens=6", "rollout.native.max_batch_size=32",
            "rollout.native.max_seq_len=80"]
    cfg = load_config(RlhfConfig, RECIPES / f"{name}.yaml", tiny + extra)
    preflight(cfg, dist.get_world_size())
    run_dir = setup_run(cfg.run, cfg, defer_config=True)
    try:
        return Trainer(cfg, run_dir).fit()
    finally:
        close_run()


def _two_rank_recipes(paths: dict[str, str], root: str) -> dict[str, list[dict]]:
    grpo = ["data.prompts_per_step=4", "sampling.n=4"]
    return {
        "grpo": _one_step(paths, root, "grpo_smollm2_gsm8k", grpo),
        "relaunched": _one_step(paths, root, "grpo_smollm2_gsm8k", grpo),  # finished: nothing left to run
        "ppo": _one_step(paths, root, "ppo_critic", ["data.prompts_per_step=8", "actor.micro_batch_size=2",
                                                     "critic.micro_batch_size=2", *NO_WARMUP]),
        "rm": _one_step(paths, root, "reward_model", ["data.prompts_per_step=4",
                                                      f"reward.model_path={paths['reward_model']}"]),
        "multi_node": _one_step(paths, root, "multi_node", [  # 2 x 8 GPUs' layout brought down to 2 CPU ranks
            "data.prompts_per_step=4", "mesh.actor.tp=2", "mesh.ref.tp=2", "rollout.engine=native", *NO_WARMUP]),
    }


def _assert_trained(history: list[dict]) -> dict:
    row = history[-1]
    assert row["step"] == 1 and math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
    return row


def test_recipes_run_one_step_on_two_ranks(tmp_path):
    paths = _tiny_setup(tmp_path)
    runs = run_distributed(_two_rank_recipes, 2, paths, str(tmp_path), timeout_s=900)[0]
    grpo = _assert_trained(runs["grpo"])
    assert "timing_s/old_log_prob" not in grpo  # strictly on-policy: auto skips the old-logprob forward
    assert "val/score/mean@1" in runs["grpo"][0]  # validation scored by the gsm8k rule reward
    run = tmp_path / "grpo-smollm2-gsm8k"
    console = [line.split(": ", 1)[1] for line in (run / "rank0.log").read_text().splitlines()]
    assert f"checkpoint: {run}/checkpoints/step_1" in console  # the end summary
    assert (f"next, the actor as an HF folder (one process, whatever the world size): rlhf export --run-dir {run} "
            f"--out {run}/hf") in console
    assert runs["relaunched"] == [] and console[-1] == (
        f"{run} already finished: its checkpoint is at step 1 and trainer.total_steps=1; raise trainer.total_steps "
        "to train on, or start afresh with another run.name (or checkpoint.resume=none)")
    ppo = _assert_trained(runs["ppo"])
    assert "critic/vf_loss" in ppo and "timing_s/old_log_prob" in ppo  # two epochs: the forward runs
    rm = _assert_trained(runs["rm"])
    assert "timing_s/reward" in rm and rm["critic/score/max"] != rm["critic/score/min"]
    _assert_trained(runs["multi_node"])


def _split_recipe(paths: dict[str, str], root: str) -> list[dict]:
    return _one_step(paths, root, "split_8rank", [f"reward.model_path={paths['reward_model']}"])


@pytest.mark.slow
def test_split_recipe_runs_one_step_on_eight_ranks(tmp_path):
    paths = _tiny_setup(tmp_path)
    row = _assert_trained(run_distributed(_split_recipe, 8, paths, str(tmp_path), timeout_s=1200)[0])
    assert "critic/vf_loss" in row and "timing_s/reward" in row

"""The root config (rlhf.orchestration.schema): `auto` token budgets resolve to micro_batch_size x the longest row
before anything reads them, in every kind of run, and the run folder's config.yaml records the int."""

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import trainer_config  # noqa: E402

from rlhf.config import load_config  # noqa: E402
from rlhf.errors import ConfigError  # noqa: E402
from rlhf.orchestration.schema import RlhfConfig, longest_row  # noqa: E402


def _budgets(cfg: RlhfConfig) -> dict[str, int]:
    return {"actor": cfg.actor.max_tokens_per_microbatch, "critic": cfg.critic.max_tokens_per_microbatch,
            "ref": cfg.ref.max_tokens_per_microbatch, "reward": cfg.reward.model_max_tokens_per_microbatch,
            "actor_forward": cfg.actor.forward_tokens_per_microbatch}


def _config(tmp_path, *overrides: str) -> RlhfConfig:
    paths = {"model": str(tmp_path / "model"), "train": str(tmp_path / "t.parquet"), "val": str(tmp_path / "v.parquet")}
    return trainer_config(paths, str(tmp_path / "runs"), list(overrides))


def test_auto_budgets_are_micro_batch_size_times_the_longest_row(tmp_path):
    # GRPO (fixtures: 16-token prompts + 5-token responses; actor and critic 4 rows, ref and reward model 8)
    assert _budgets(_config(tmp_path)) == {"actor": 84, "critic": 84, "ref": 168, "reward": 168,
                                           "actor_forward": 84}
    # PPO with a critic of its own micro-batch size, and a forward-only budget of the user's: the reference's
    # forward-only passes take the actor's forward-only budget where it is larger than its own
    ppo = _config(tmp_path, "algo.advantage.kind=gae", "critic.micro_batch_size=2", "ref.micro_batch_size=3",
                  "actor.forward_max_tokens_per_microbatch=500", "reward.model_micro_batch_size=1")
    assert _budgets(ppo) == {"actor": 84, "critic": 42, "ref": 500, "reward": 21, "actor_forward": 500}
    whole = _config(tmp_path, "actor.micro_batch_size=32")  # the actor's update takes the whole batch at once
    assert _budgets(whole) == {"actor": 672, "critic": 84, "ref": 672, "reward": 168, "actor_forward": 672}
    # multi-turn: a row is bounded by its token budget (prompt + every response and observation token)
    multiturn = _config(tmp_path, "multiturn.enable=true", "multiturn.agent=agent.py:run",
                        "multiturn.limits.token_budget=200")
    assert longest_row(multiturn) == (200, "multiturn.limits.token_budget=200")
    assert _budgets(multiturn) == {"actor": 800, "critic": 800, "ref": 1600, "reward": 1600, "actor_forward": 800}
    # top-K distillation packs too (the packs carry the teacher's ids)
    topk = _config(tmp_path, "algo.distill.enable=true", "algo.distill.estimator=topk",
                   f"algo.distill.teacher_path={tmp_path / 'model'}")
    assert _budgets(topk) == {"actor": 84, "critic": 84, "ref": 168, "reward": 168, "actor_forward": 84}
    # explicit values are kept; 0 is row counts
    explicit = _config(tmp_path, "actor.max_tokens_per_microbatch=0", "ref.max_tokens_per_microbatch=77")
    assert _budgets(explicit) == {"actor": 0, "critic": 84, "ref": 77, "reward": 168, "actor_forward": 0}


def test_sft_run_config_keeps_the_resolved_actor_budget(tmp_path):
    from rlhf.orchestration.sft import sft_run_config

    run = sft_run_config(_config(tmp_path, "actor.micro_batch_size=2"))
    assert run.actor.max_tokens_per_microbatch == 2 * (16 + 5)  # the data check of SFT rows: test_sft_run


def test_budgets_from_yaml_and_overrides(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("actor: {max_tokens_per_microbatch: auto, micro_batch_size: 2}\nref: "
                      "{max_tokens_per_microbatch: 96}\ndata: {max_prompt_length: 10}\nsampling: {max_new_tokens: 6}\n")
    cfg = load_config(RlhfConfig, config, ["reward.model_max_tokens_per_microbatch=auto", "critic.micro_batch_size=1"])
    assert _budgets(cfg) == {"actor": 32, "critic": 16, "ref": 96, "reward": 128, "actor_forward": 32}
    assert load_config(RlhfConfig, config, ["actor.max_tokens_per_microbatch=0"]).actor.max_tokens_per_microbatch == 0
    for text, message in (("actor.max_tokens_per_microbatch=always",
                           r"^actor\.max_tokens_per_microbatch='always' must be an integer or 'auto'$"),
                          ("ref.max_tokens_per_microbatch=-2",
                           r"^ref\.max_tokens_per_microbatch=-2 must be auto, 0 \(row-count micro-batches\) or a "
                           r"token count >= 1$"),
                          ("critic.forward_max_tokens_per_microbatch=auto",
                           r"^critic\.forward_max_tokens_per_microbatch='auto' must be an integer$")):
        with pytest.raises(ConfigError, match=message):
            load_config(RlhfConfig, None, [text])


def test_config_yaml_records_the_resolved_ints(tmp_path):
    from rlhf.run_dir import close_run, setup_run

    cfg = _config(tmp_path, "run.name=budgets")
    run_dir = setup_run(cfg.run, cfg)
    try:
        saved = yaml.safe_load((run_dir.path / "config.yaml").read_text())
    finally:
        close_run()
    assert (saved["actor"]["max_tokens_per_microbatch"], saved["critic"]["max_tokens_per_microbatch"],
            saved["ref"]["max_tokens_per_microbatch"], saved["reward"]["model_max_tokens_per_microbatch"]) == \
        (84, 84, 168, 168)
    assert load_config(RlhfConfig, run_dir.path / "config.yaml").actor.max_tokens_per_microbatch == 84

"""Config traps a newcomer fell into: a single data file as a string, `~` in paths, and the old-logprob forward
that stayed on for strictly on-policy runs (19-23 s of a ~120 s SmolLM2 step)."""

from __future__ import annotations

import os

import pytest

from rlhf.config import load_config
from rlhf.orchestration.schema import RlhfConfig
from rlhf.errors import ConfigError
from rlhf.stages.config import UpdateConfig


def test_a_single_file_and_home_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(RlhfConfig, None, [
        "data.train_files=~/gsm8k.parquet", "data.val_files=[~/a.jsonl, b.jsonl]", "model.path=~/SmolLM2",
        "model.critic_path=~/critic", "run.output_dir=~/runs", "checkpoint.resume=~/runs/x/checkpoints/step_3",
        "reward.model_path=~/rm", "sft.out_dir=~/sft"])
    home = str(tmp_path)
    assert cfg.data.train_files == [f"{home}/gsm8k.parquet"]
    assert cfg.data.val_files == [f"{home}/a.jsonl", "b.jsonl"]
    assert (cfg.model.path, cfg.model.critic_path, cfg.reward.model_path, cfg.sft.out_dir) == (
        f"{home}/SmolLM2", f"{home}/critic", f"{home}/rm", f"{home}/sft")
    assert cfg.run.output_dir == os.path.join(home, "runs")
    assert cfg.checkpoint.resume == f"{home}/runs/x/checkpoints/step_3"
    assert load_config(RlhfConfig, None, ["checkpoint.resume=auto"]).checkpoint.resume == "auto"


@pytest.mark.parametrize("setting, epochs, mini_batches, forward", [
    ("auto", 1, 1, False),  # strictly on-policy: the update's own logprobs are the old ones
    ("auto", 2, 1, True), ("auto", 1, 2, True),
    (True, 1, 1, True), (False, 1, 1, False),
])
def test_old_logprob_forward_is_automatic(setting, epochs, mini_batches, forward):
    update = UpdateConfig(recompute_old_logprobs=setting, epochs=epochs, mini_batches=mini_batches)
    assert update.old_logprobs_forward is forward


def test_old_logprob_forward_bad_values():
    with pytest.raises(ConfigError, match=r"^recompute_old_logprobs=false needs one on-policy update per batch, "
                                          r"got epochs=2 and mini_batches=1; set both to 1 or use auto$"):
        UpdateConfig(recompute_old_logprobs=False, epochs=2)
    with pytest.raises(ConfigError, match=r"^actor\.recompute_old_logprobs='sometimes' must be true or false or "
                                          r"'auto'$"):
        load_config(RlhfConfig, None, ["actor.recompute_old_logprobs=sometimes"])

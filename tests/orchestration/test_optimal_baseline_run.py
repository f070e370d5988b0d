"""The optimal token baseline in the RL step, on 2 ranks in one launched world: its advantages equal the estimator
fed transformers' sum_v pi(v)^2 of the sampled positions, and are the same at another micro-batch size and at
dp=1 (actor tp=2); settings that cannot feed it are one-line errors."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import hf_response_logprobs, length_reward, make_tiny_setup, run_trainer, trainer_config  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

COMMON = ["trainer.val_before_train=false", "reward.by_source={}", "trainer.total_steps=1",
          "algo.advantage.kind=optimal_token_baseline", "dist.seed=7"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("otb")
    return make_tiny_setup(root, num_train=16, num_val=4) | {"reward": length_reward(root, modulo=3)}


def _hf_sum_pi_squared(path: str, batch):
    """sum_v pi(v)^2 at each position predicting a response token, from transformers' full logits, `[B, T]`."""
    return hf_response_logprobs(path, batch).exp().square().sum(-1) * batch.response_mask_bt


def _otb_world(paths: dict, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from rlhf.algo.advantages import AdvantageInputs, compute_advantages
    from rlhf.algo.config import AdvantageConfig
    from rlhf.algo.groups import Groups

    scored = {}
    layouts = {"dp2": [], "micro8": ["actor.micro_batch_size=8"],
               "tp2": ["mesh.actor.tp=2", "actor.micro_batch_size=8", "algo.rollout_correction.enable=false"]}
    for name, overrides in layouts.items():
        run_trainer(paths, root, COMMON + [paths["reward"], f"run.name={name}"] + overrides,
                    on_scored=lambda batch, step, name=name: scored.__setitem__(name, batch))
    out = {}
    base = scored["dp2"]
    for name in ("micro8", "tp2"):
        out[f"{name}_same_tokens"] = torch.equal(scored[name].tokens_bs, base.tokens_bs)
        out[f"{name}_advantage_diff"] = float((scored[name].advantages_bt - base.advantages_bt).abs().max())
    if dist.get_rank() == 0:
        expected = compute_advantages(AdvantageConfig(kind="optimal_token_baseline"), AdvantageInputs(
            token_rewards_bt=base.token_rewards_bt, response_mask_bt=base.response_mask_bt,
            groups=Groups.from_index(base.group_index_b), old_logprobs_bt=base.old_logprobs_bt,
            sum_pi_squared_bt=_hf_sum_pi_squared(paths["model"], base)))
        out["hf_advantage_diff"] = float((expected.advantages_bt - base.advantages_bt).abs().max())
        out["advantage_nonzero"] = bool(base.advantages_bt.abs().sum() > 0)
    return out


@pytest.mark.slow  # three trainer runs: past the default suite's time budget
def test_optimal_token_baseline_world(setup, tmp_path):
    out = run_distributed(_otb_world, 2, setup, str(tmp_path), timeout_s=600)[0]
    assert out["micro8_same_tokens"] and out["tp2_same_tokens"], out
    assert out["micro8_advantage_diff"] < 1e-5 and out["tp2_advantage_diff"] < 1e-5, out
    assert out["hf_advantage_diff"] < 1e-4 and out["advantage_nonzero"], out


@pytest.mark.parametrize("overrides, message", [
    (["model.fused_head=false"], "algo.advantage.kind=optimal_token_baseline reads each position's sum of squared "
                                 "probabilities from the fused LM head; set model.fused_head=true"),
    (["algo.rollout_correction.bypass_mode=true", "algo.rollout_correction.rollout_is=null"],
     "algo.advantage.kind=optimal_token_baseline reads the actor's old-logprob forward, which "
     "algo.rollout_correction.bypass_mode=true skips; set bypass_mode=false or choose another estimator"),
])
def test_settings_that_cannot_feed_it_are_one_line(setup, tmp_path, overrides, message):
    from rlhf.errors import ConfigError
    from rlhf.orchestration.setting_checks import check_algo_settings

    cfg = trainer_config(setup, str(tmp_path), COMMON + overrides)
    with pytest.raises(ConfigError) as error:
        check_algo_settings(cfg)
    assert str(error.value) == message

"""Clip-Cov and KL-Cov in the RL step, on 2 ranks in one launched world: the step's token selection is drawn once
on the global batch, so the update (loss, gradient norm, the selected tokens) is the same at another micro-batch
size and at dp=1 (actor tp=2)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import length_reward, make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

# ratios large enough that a few of the ~80 response tokens are selected; clip-cov's band holds the tiny model's
COMMON = ["trainer.val_before_train=false", "reward.by_source={}", "trainer.total_steps=1", "dist.seed=7",
          "algo.policy_loss.kl_cov_ratio=0.1", "algo.policy_loss.clip_cov_ratio=0.1",
          "algo.policy_loss.clip_cov_lb=-10.0", "algo.policy_loss.clip_cov_ub=10.0", "actor.optim.lr=0.05"]
LAYOUTS = {"dp2": [], "micro8": ["actor.micro_batch_size=8"],
           "tp2": ["mesh.actor.tp=2", "actor.micro_batch_size=8", "algo.rollout_correction.enable=false"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cov")
    return make_tiny_setup(root, num_train=16, num_val=4) | {"reward": length_reward(root, modulo=3)}


def _cov_world(paths: dict, root: str) -> dict:
    import torch

    out = {}
    for kind, layouts in (("clip_cov", ("dp2", "micro8")), ("kl_cov", ("dp2", "tp2"))):
        rows, scored = {}, {}
        for name in layouts:
            overrides = COMMON + [paths["reward"], f"run.name={kind}_{name}", f"algo.policy_loss.kind={kind}"]
            rows[name] = run_trainer(paths, root, overrides + LAYOUTS[name],
                                     on_scored=lambda batch, step, name=name: scored.__setitem__(name, batch))[0]
        first, second = layouts
        out[kind] = {"selected": int(scored[first].cov_selected_bt.sum()),
                     "same_selection": torch.equal(scored[first].cov_selected_bt, scored[second].cov_selected_bt),
                     "loss_diff": abs(rows[first]["actor/pg_loss"] - rows[second]["actor/pg_loss"]),
                     "grad_norm_diff": abs(rows[first]["actor/grad_norm"] - rows[second]["actor/grad_norm"]),
                     "clipfrac": rows[first]["actor/pg_clipfrac"]}
    return out


@pytest.mark.slow  # four trainer runs: past the default suite's time budget
def test_covariance_losses_are_layout_invariant(setup, tmp_path):
    out = run_distributed(_cov_world, 2, setup, str(tmp_path), timeout_s=600)[0]
    for kind, result in out.items():
        assert result["selected"] > 0 and result["same_selection"], (kind, result)
        assert result["loss_diff"] < 1e-6 and result["grad_norm_diff"] < 1e-5, (kind, result)
        assert result["clipfrac"] > 0, (kind, result)

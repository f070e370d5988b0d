"""rlhf against verl 0.9.0's own outputs: every new policy loss (value and gradient), estimator, rollout correction
and bypass loss on one fixed batch. golden/verl_0_9_outputs.json holds the inputs and what verl's functions
(verl/trainer/ppo/core_algos.py, rollout_corr_helper.py at release/v0.9.0, run with omegaconf, its config classes
and DataProto stubbed) returned on them. Cases avoid rlhf's documented departures (singleton groups, empty rows)."""

import json
from pathlib import Path

import pytest
import torch

from rlhf.algo.actor_loss import ActorLossInputs, actor_loss
from rlhf.algo.advantages import AdvantageInputs, compute_advantages
from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import AdvantageConfig, KLConfig, PolicyLossConfig
from rlhf.algo.correction_config import RolloutCorrectionConfig
from rlhf.algo.groups import Groups
from rlhf.algo.policy_loss import policy_loss
from rlhf.algo.policy_loss_cov import COVARIANCE_KINDS, covariance_selection
from rlhf.algo.rollout_correction import rollout_correction

GOLDEN = json.loads((Path(__file__).parent / "golden" / "verl_0_9_outputs.json").read_text())
F64 = torch.float64
TOL = 1e-8  # verl adds 1e-8 to some denominators rlhf clamps instead
GDPO_TOL = 1e-6  # verl computes GDPO in float32 (its components become float32 token scores)


def _t(name):
    return torch.tensor(GOLDEN["inputs"][name], dtype=F64)


MASK, OLD, ROLLOUT, ADV, WEIGHTS = _t("mask"), _t("old"), _t("rollout"), _t("advantages"), _t("weights")
COUNTS = GlobalCounts.of(MASK)
LENGTHS = MASK.sum(dim=-1).long()
GROUPS = Groups.from_index(torch.tensor(GOLDEN["inputs"]["index"]))


def _close(got, want, atol=TOL):
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=0, atol=atol)


@pytest.mark.parametrize("key", sorted(GOLDEN["losses"]))
def test_policy_loss_matches_verl(key):
    case = GOLDEN["losses"][key]
    new = torch.tensor(GOLDEN["inputs"]["news"][str(case["spread"])], dtype=F64, requires_grad=True)
    config = PolicyLossConfig(kind=case["kind"], clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, agg=case["agg"],
                              **GOLDEN["cov"])
    selected = None
    if config.kind in COVARIANCE_KINDS:  # verl selects from the current log-probs of this batch
        selected = covariance_selection(config, ADV, new.detach(), MASK, torch.Generator())
    loss, _ = policy_loss(new, OLD, ADV, MASK, config, COUNTS, is_weights_bt=WEIGHTS if case["weighted"] else None,
                          cov_selected_bt=selected)
    (grad,) = torch.autograd.grad(loss, new)
    assert loss.item() == pytest.approx(case["loss"], rel=0, abs=TOL)
    _close(grad * MASK, case["grad"])


@pytest.mark.parametrize("key", sorted(GOLDEN["advantages"]))
def test_estimator_matches_verl(key):
    kind, label = key.split("/")
    scores = torch.tensor(GOLDEN["inputs"]["scores"][label], dtype=F64)
    rewards = torch.zeros_like(MASK)
    rewards[torch.arange(MASK.shape[0]), LENGTHS - 1] = scores
    weighted = kind.endswith("+is")
    kind = kind.removesuffix("+is")
    config = AdvantageConfig(kind=kind, gdpo_reward_keys=["x", "y"], gdpo_reward_weights=[1.0, 0.5])
    inputs = AdvantageInputs(token_rewards_bt=rewards, response_mask_bt=MASK, groups=GROUPS,
                             reward_components_bk=_t("components"), old_logprobs_bt=OLD,
                             sum_pi_squared_bt=_t("sum_pi_squared"), is_weights_bt=WEIGHTS if weighted else None)
    _close(compute_advantages(config, inputs).advantages_bt, GOLDEN["advantages"][key],
           atol=GDPO_TOL if kind == "gdpo" else TOL)


@pytest.mark.parametrize("case", GOLDEN["corrections"], ids=lambda case: ",".join(map(str, case["config"].values())))
def test_rollout_correction_matches_verl(case):
    result = rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(enable=True, **case["config"]))
    assert result.keep_mask_bt.tolist() == case["keep"]
    if case["weights"] is None:
        assert result.weights_bt is None
    else:
        _close(result.weights_bt, case["weights"])


@pytest.mark.parametrize("loss_type", sorted(GOLDEN["bypass"]))
def test_bypass_loss_matches_verl(loss_type):
    case = GOLDEN["bypass"][loss_type]
    new = torch.tensor(GOLDEN["inputs"]["news"]["0.3"], dtype=F64, requires_grad=True)
    inputs = ActorLossInputs(logprobs_bt=new, old_logprobs_bt=ROLLOUT, advantages_bt=ADV, response_mask_bt=MASK)
    loss, _ = actor_loss(inputs, PolicyLossConfig(clip_low=0.2, clip_high=0.28), KLConfig(), COUNTS,
                         RolloutCorrectionConfig(enable=True, bypass_mode=True, **case["config"]))
    (grad,) = torch.autograd.grad(loss, new)
    assert loss.item() == pytest.approx(case["loss"], rel=0, abs=TOL)
    _close(grad, case["grad"])


def test_the_golden_cases_exercise_clipping_selection_and_rejection():
    kept = [sum(map(sum, case["keep"])) for case in GOLDEN["corrections"]]
    assert min(kept) < MASK.sum() and max(kept) == MASK.sum()
    assert len(GOLDEN["losses"]) == 20 and len(GOLDEN["advantages"]) == 12

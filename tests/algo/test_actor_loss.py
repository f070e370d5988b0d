import pytest
import torch

from rlhf.algo.actor_loss import ActorLossInputs, actor_loss
from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import KLConfig, PolicyLossConfig
from rlhf.algo.kl import kl_loss
from rlhf.algo.policy_loss import policy_loss
from rlhf.errors import ConfigError


def _inputs():
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 4, generator=gen)).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    return ActorLossInputs(logprobs_bt=logp, old_logprobs_bt=logp.detach() - 0.1,
                           advantages_bt=torch.randn(2, 4, generator=gen), response_mask_bt=mask, ref_logprobs_bt=logp.detach() + 0.2,
                           entropy_bt=torch.rand(2, 4, generator=gen).requires_grad_())


def test_total_is_policy_minus_entropy_plus_kl():
    inputs = _inputs()
    counts = GlobalCounts.of(inputs.response_mask_bt)
    policy_config = PolicyLossConfig(entropy_coef=0.01)
    kl_config = KLConfig(estimator="k3", coef=0.05)
    total, metrics = actor_loss(inputs, policy_config, kl_config, counts)
    pg, _ = policy_loss(inputs.logprobs_bt, inputs.old_logprobs_bt, inputs.advantages_bt, inputs.response_mask_bt,
                        policy_config, counts)
    kl_term, kl_value = kl_loss(inputs.logprobs_bt, inputs.ref_logprobs_bt, inputs.response_mask_bt, kl_config, counts)
    entropy = (inputs.entropy_bt * inputs.response_mask_bt).sum() / 5
    torch.testing.assert_close(total, pg - 0.01 * entropy + kl_term)
    logged = metrics.as_dict()
    assert logged["actor/kl_loss"] == kl_value and "actor/kl_coef" not in logged  # a constant, not a share
    torch.testing.assert_close(logged["actor/entropy"], entropy.detach())


def test_kl_in_reward_adds_no_loss_term():
    inputs = _inputs()
    counts = GlobalCounts.of(inputs.response_mask_bt)
    total, metrics = actor_loss(inputs, PolicyLossConfig(), KLConfig(coef=0.05, in_reward=True), counts)
    pg, _ = policy_loss(inputs.logprobs_bt, inputs.old_logprobs_bt, inputs.advantages_bt, inputs.response_mask_bt,
                        PolicyLossConfig(), counts)
    torch.testing.assert_close(total, pg)
    assert "actor/kl_loss" not in metrics.as_dict()


def test_missing_tensors_are_reported():
    inputs = _inputs()
    counts = GlobalCounts.of(inputs.response_mask_bt)
    inputs.ref_logprobs_bt = None
    with pytest.raises(ConfigError, match="KL loss \\(coef=0.05, in_reward=false\\) needs reference log-probs"):
        actor_loss(inputs, PolicyLossConfig(), KLConfig(coef=0.05), counts)
    inputs.entropy_bt = None
    with pytest.raises(ConfigError, match="entropy_coef=0.01 needs the per-token entropy"):
        actor_loss(inputs, PolicyLossConfig(entropy_coef=0.01), KLConfig(), counts)

"""End to end sign check: every estimator (with PPO) and every policy loss (with GRPO) teaches a toy bandit policy
to pick the rewarded token."""

import pytest
import torch

from rlhf.algo.advantages import AdvantageInputs, compute_advantages, scores_to_token_rewards
from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import AdvantageConfig, AdvantageKind, PolicyLossConfig, PolicyLossKind, ValueLossConfig
from rlhf.algo.groups import Groups
from rlhf.algo.policy_loss import policy_loss
from rlhf.algo.policy_loss_cov import COVARIANCE_KINDS, covariance_selection
from rlhf.algo.value_loss import value_loss

VOCAB, WIDTH, PROMPTS, SAMPLES, GOOD = 4, 3, 4, 4, 2


def _score_b(tokens_bt: torch.Tensor) -> torch.Tensor:
    return (tokens_bt == GOOD).double().mean(dim=-1)


def _train(kind: AdvantageKind, steps: int = 25, loss_kind: PolicyLossKind = PolicyLossKind.PPO) -> float:
    gen = torch.Generator().manual_seed(0)
    logits_v = torch.zeros(VOCAB, dtype=torch.float64, requires_grad=True)
    values_t = torch.zeros(WIDTH, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam([logits_v, values_t], lr=0.1)
    batch = PROMPTS * SAMPLES
    mask = torch.ones(batch, WIDTH)
    mask[::3, 2] = 0.0  # some shorter responses
    counts = GlobalCounts.of(mask)
    for _ in range(steps):
        probs_v = torch.softmax(logits_v.detach(), dim=-1)
        tokens_bt = torch.multinomial(probs_v, batch * WIDTH, replacement=True, generator=gen).view(batch, WIDTH)
        greedy_bt = torch.full((batch, WIDTH), int(probs_v.argmax()))
        old_values = values_t.detach().expand(batch, WIDTH)
        logp_bt = torch.log_softmax(logits_v, dim=-1)[tokens_bt]
        scores_b = _score_b(tokens_bt * mask.long())
        inputs = AdvantageInputs(token_rewards_bt=scores_to_token_rewards(scores_b, mask),
                                 response_mask_bt=mask, values_bt=old_values, groups=Groups.contiguous(batch, SAMPLES),
                                 baseline_scores_b=_score_b(greedy_bt * mask.long()),
                                 reward_components_bk=scores_b[:, None], old_logprobs_bt=logp_bt.detach(),
                                 sum_pi_squared_bt=probs_v.square().sum().expand(batch, WIDTH))
        advantages = compute_advantages(AdvantageConfig(kind=kind, gdpo_reward_keys=["score"]), inputs)
        loss_config = PolicyLossConfig(kind=loss_kind, clip_cov_ratio=0.1, kl_cov_ratio=0.1)
        selected_bt = None
        if loss_kind in COVARIANCE_KINDS:
            selected_bt = covariance_selection(loss_config, advantages.advantages_bt, logp_bt.detach(), mask, gen)
        loss, _ = policy_loss(logp_bt, logp_bt.detach(), advantages.advantages_bt, mask, loss_config, counts,
                              cov_selected_bt=selected_bt)
        if kind is AdvantageKind.GAE:
            vf, _ = value_loss(values_t.expand(batch, WIDTH), old_values, advantages.returns_bt, mask,
                               ValueLossConfig(), counts)
            loss = loss + vf
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return torch.softmax(logits_v.detach(), dim=-1)[GOOD].item()


@pytest.mark.parametrize("kind", list(AdvantageKind))
def test_policy_learns_the_rewarded_token(kind):
    assert _train(kind) > 0.85  # starts at 1 / VOCAB = 0.25; every kind reaches ~0.93-0.95


@pytest.mark.parametrize("loss_kind", list(PolicyLossKind))
def test_every_policy_loss_learns_the_rewarded_token(loss_kind):
    assert _train(AdvantageKind.GRPO, loss_kind=loss_kind) > 0.85

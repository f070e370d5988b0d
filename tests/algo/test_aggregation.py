import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algo.aggregation import GlobalCounts, aggregate_loss
from rlhf.algo.config import KLConfig, LossAggMode, PolicyLossConfig, ValueLossConfig
from rlhf.algo.kl import kl_loss
from rlhf.algo.policy_loss import policy_loss
from rlhf.algo.value_loss import value_loss
from rlhf.errors import ConfigError

T = torch.tensor
NAN = float("nan")


def _mask(lengths, width):
    return (torch.arange(width).unsqueeze(0) < T(lengths).unsqueeze(1)).float()


def test_each_mode_hand_computed_and_padding_nan_ignored():
    loss = T([[1.0, 2.0, NAN], [4.0, NAN, NAN]])
    mask = _mask([2, 1], 3)
    counts = GlobalCounts(num_tokens=3, num_seqs=2)
    expected = {LossAggMode.TOKEN_MEAN: 7 / 3, LossAggMode.TOKEN_SUM: 7.0, LossAggMode.SEQ_MEAN_TOKEN_SUM: 3.5,
                LossAggMode.SEQ_MEAN_TOKEN_MEAN: 2.75, LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM: 0.875}
    for mode, value in expected.items():
        got = aggregate_loss(loss, mask, mode=mode, counts=counts, norm_length=4)
        assert got.item() == pytest.approx(value), mode


def test_token_sum_gradient_is_one_per_response_token():
    loss = torch.zeros(2, 3, requires_grad=True)
    mask = _mask([2, 1], 3)
    out = aggregate_loss(loss, mask, mode=LossAggMode.TOKEN_SUM, counts=GlobalCounts(num_tokens=3, num_seqs=2))
    (grad,) = torch.autograd.grad(out, loss)
    assert torch.equal(grad, mask)


def test_counts_of_a_shard():
    mask = _mask([2, 0, 3], 4)
    assert GlobalCounts.local_tensor(mask).tolist() == [5, 2]
    assert GlobalCounts.of(mask) == GlobalCounts(num_tokens=5, num_seqs=2)


def test_empty_mask_gives_zero_loss_and_zero_grad():
    loss = torch.randn(2, 3, requires_grad=True)
    for mode in LossAggMode:
        out = aggregate_loss(loss, torch.zeros(2, 3), mode=mode, counts=GlobalCounts(num_tokens=0, num_seqs=0),
                             norm_length=3)
        (grad,) = torch.autograd.grad(out, loss)
        assert out.item() == 0.0 and torch.equal(grad, torch.zeros(2, 3)), mode


def test_sum_norm_needs_a_constant_length():
    with pytest.raises(ConfigError) as err:
        PolicyLossConfig(agg="seq-mean-token-sum-norm")
    assert str(err.value) == ("loss aggregation 'seq-mean-token-sum-norm' needs a constant agg_norm_length >= 1 "
                              "(e.g. the max response length), got None")
    with pytest.raises(ConfigError, match="unknown loss aggregation mode 'token_mean' \\(did you mean 'token-mean'"):
        PolicyLossConfig(agg="token_mean")


@st.composite
def sharded_batches(draw):
    batch = draw(st.integers(1, 8))
    width = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    order = draw(st.permutations(range(batch)))
    cuts = sorted(draw(st.lists(st.integers(0, batch), max_size=4)))
    seed = draw(st.integers(0, 2**16))
    return lengths, width, list(order), cuts, seed


@settings(max_examples=80, deadline=None)
@given(sharded_batches(), st.sampled_from(list(LossAggMode)))
def test_shard_losses_with_global_counts_sum_to_full_batch_loss(batch, mode):
    """Any partition of the rows (DP shards x micro-batches, each trimmed to its own padded width)."""
    lengths, width, order, cuts, seed = batch
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(len(lengths), width, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = _mask(lengths, width).double()
    counts = GlobalCounts.of(mask)
    full = aggregate_loss(weight.square(), mask, mode=mode, counts=counts, norm_length=7)
    (full_grad,) = torch.autograd.grad(full, weight)
    total = torch.zeros((), dtype=torch.float64)
    for start, stop in zip([0, *cuts], [*cuts, len(order)]):
        rows = T(order[start:stop], dtype=torch.long)
        shard_width = max([lengths[i] for i in order[start:stop]], default=0)
        shard_loss = weight[rows, :shard_width].square()
        total = total + aggregate_loss(shard_loss, mask[rows, :shard_width], mode=mode, counts=counts, norm_length=7)
    (shard_grad,) = torch.autograd.grad(total, weight)
    assert abs(total.item() - full.item()) <= 1e-6
    torch.testing.assert_close(shard_grad, full_grad, atol=1e-6, rtol=0)


@settings(max_examples=40, deadline=None)
@given(sharded_batches(), st.sampled_from(list(LossAggMode)), st.sampled_from(["ppo", "gspo"]))
def test_policy_value_kl_losses_and_metrics_are_shard_invariant(batch, mode, kind):
    lengths, width, order, cuts, seed = batch
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(len(lengths), width, generator=gen, dtype=torch.float64) * 0.3
               for name in ["old", "adv", "ref", "values", "old_values", "returns"]}
    theta = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    mask = _mask(lengths, width).double()
    counts = GlobalCounts.of(mask)
    policy_config = PolicyLossConfig(kind=kind, agg=mode, agg_norm_length=7, clip_low=0.05, clip_high=0.1)
    value_config = ValueLossConfig(agg=mode, agg_norm_length=7, clip_range_value=0.1)
    kl_config = KLConfig(estimator="k3", coef=0.1, agg=mode, agg_norm_length=7)

    def losses(rows):
        t = {name: value[rows] for name, value in tensors.items()}
        logp = t["old"] + theta * t["adv"]
        pg, pg_metrics = policy_loss(logp, t["old"], t["adv"], mask[rows], policy_config, counts)
        vf, vf_metrics = value_loss(t["values"] * theta, t["old_values"], t["returns"], mask[rows], value_config,
                                    counts)
        kl, _ = kl_loss(logp, t["ref"], mask[rows], kl_config, counts)
        return torch.stack([pg + vf + kl, pg_metrics.pg_clipfrac, pg_metrics.ppo_kl, vf_metrics.vf_clipfrac])

    full = losses(slice(None))
    (full_grad,) = torch.autograd.grad(full[0], theta)
    shards = [losses(T(order[a:b], dtype=torch.long)) for a, b in zip([0, *cuts], [*cuts, len(order)])]
    total = torch.stack(shards).sum(dim=0)
    (shard_grad,) = torch.autograd.grad(total[0], theta)
    torch.testing.assert_close(total.detach(), full.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(shard_grad, full_grad, atol=1e-6, rtol=0)

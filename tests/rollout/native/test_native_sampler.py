"""Native sampler: filters equal transformers' warpers, draws follow the distribution, seeds reproduce."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from rlhf.rollout.native.sampler import _top_k, _top_p, sample
from rlhf.rollout.sampling_params import SamplingParams


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.9), (20, 0.5), (-1, 0.05), (3, 0.999)])
def test_filters_match_transformers(top_k, top_p):
    logits = torch.randn(16, 101, generator=torch.Generator().manual_seed(1)) * 3
    ours = _top_p(_top_k(logits / 0.7, top_k), top_p)
    theirs = TemperatureLogitsWarper(0.7)(None, logits.clone())
    if top_k > 0:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(ours.isinf(), theirs.isinf())
    torch.testing.assert_close(ours[~ours.isinf()], theirs[~theirs.isinf()])


def test_draws_follow_the_distribution_and_seed_reproduces():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(20000, 1)
    params = SamplingParams(max_new_tokens=1, temperature=1.0)
    first = sample(logits, params, torch.Generator().manual_seed(7))
    again = sample(logits, params, torch.Generator().manual_seed(7))
    assert torch.equal(first.tokens_k, again.tokens_k)
    freq = torch.bincount(first.tokens_k, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.015, rtol=0)
    torch.testing.assert_close(first.logprobs_k, torch.log_softmax(logits, -1).gather(-1, first.tokens_k[:, None])[:, 0])


def test_greedy_and_scaled_logprobs():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    greedy = sample(logits, SamplingParams(max_new_tokens=1, temperature=0.0), torch.Generator())
    assert torch.equal(greedy.tokens_k, logits.argmax(-1))
    assert torch.equal(greedy.logprobs_k, greedy.scaled_logprobs_k)
    hot = sample(logits, SamplingParams(max_new_tokens=1, temperature=2.0, top_k=3), torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits / 2.0, -1).gather(-1, hot.tokens_k[:, None])[:, 0]
    torch.testing.assert_close(hot.scaled_logprobs_k, expected)
    assert all(tok in logits[row].topk(3).indices.tolist() for row, tok in enumerate(hot.tokens_k.tolist()))


@pytest.mark.parametrize("vocab", [8 * 256, 5000])
def test_two_level_draw_follows_the_distribution_and_never_picks_filtered_tokens(vocab):
    # Mass on a few tokens spread over blocks (first, last and a partial last block), the rest filtered.
    logits = torch.full((vocab,), -30.0)
    hot = torch.tensor([0, 255, 256, 1234, vocab - 1])
    logits[hot] = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.5])
    logits = logits.repeat(20000, 1)
    params = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=5)
    drawn = sample(logits, params, torch.Generator().manual_seed(3))
    assert set(drawn.tokens_k.unique().tolist()) == set(hot.tolist())
    freq = torch.bincount(drawn.tokens_k, minlength=vocab)[hot].float() / 20000
    torch.testing.assert_close(freq, torch.softmax(logits[0, hot], -1), atol=0.015, rtol=0)
    again = sample(logits, params, torch.Generator().manual_seed(3))
    assert torch.equal(drawn.tokens_k, again.tokens_k)
    unfiltered = sample(logits[:2000], SamplingParams(max_new_tokens=1), torch.Generator().manual_seed(4))
    torch.testing.assert_close(unfiltered.logprobs_k,
                               torch.log_softmax(logits[:2000], -1).gather(-1, unfiltered.tokens_k[:, None])[:, 0])


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_among_candidates_matches_transformers(top_p):
    # 5000 tokens: rows peaked (the set inside 256 candidates), broader (inside 2048) and flat (sorted whole);
    # no tied logits (which of two tied tokens a sort keeps is arbitrary).
    generator = torch.Generator().manual_seed(5)
    scales = torch.tensor([8.0, 8.0, 3.0, 3.0, 1.0, 0.3, 0.05, 0.01])[:, None]
    logits = torch.randn(8, 5000, generator=generator) * scales
    logits[1, :40] = float("-inf")  # already filtered tokens (top-k) stay out
    ours = _top_p(logits, top_p)
    theirs = TopPLogitsWarper(top_p)(None, logits.clone())
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert torch.equal(ours[~ours.isinf()], logits[~theirs.isinf()])
    kept = (~ours.isinf()).sum(-1)
    assert kept.min() >= 1 and (top_p < 0.9 or kept.max() > 2048)  # the sorted fallback is reached

"""The kernel library's draw (`cpu_sample.c`): each token is the inverse CDF of softmax(logits / temperature) at its
row's uniform number (checked against float64 cumulative sums), the same token torch's two-level draw picks away from
rounding of a boundary, logprobs = torch's log_softmax, tokens with -inf or far-below-the-top logits never drawn, and
`sample` takes it for fp32 CPU logits."""

import shutil

import pytest
import torch

from rlhf.kernels import cpu_sample
from rlhf.platform import sampling
from rlhf.rollout.native import sampler
from rlhf.rollout.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.1, 8.0, rows)[:, None]  # flat to peaked rows
    return torch.randn(rows, vocab, generator=generator) * scales


@pytest.mark.parametrize("vocab", [7, 16, 255, 5000, 8 * 256])  # one short vector, whole vectors, a partial block
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_draw_is_the_inverse_cdf_at_the_uniform(vocab, temperature):
    kernel = cpu_sample.load()
    logits = _logits(64, vocab, vocab)
    uniform = torch.rand(64, generator=torch.Generator().manual_seed(1))
    tokens, logprobs, scaled = kernel.draw(logits, 1.0 / temperature, uniform)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    cdf = probs.cumsum(-1)
    below = torch.where(tokens > 0, cdf.gather(-1, (tokens - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    at = cdf.gather(-1, tokens[:, None])[:, 0]
    target = uniform.double()
    assert bool((below <= target + 1e-5).all()) and bool((target <= at + 1e-5).all())
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0],
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(scaled, torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None])[:, 0],
                               rtol=0, atol=1e-5)
    # torch's two-level draw on the same uniform numbers: the same tokens (no row lies within rounding of a boundary)
    if vocab >= sampler.TWO_LEVEL_MIN_VOCAB:
        torch_tokens = sampler._two_level_draw(torch.softmax(logits / temperature, -1), uniform[:, None])[:, 0]
        assert torch.equal(tokens, torch_tokens)


def test_never_draws_filtered_or_vanishing_tokens():
    kernel = cpu_sample.load()
    logits = torch.full((4000, 600), float("-inf"))
    logits[:, 0], logits[:, 299], logits[:, 599] = 0.0, 1.0, -85.0  # the last: below the floor, never drawn
    logits[:, 300:320] = -200.0
    uniform = torch.rand(4000, generator=torch.Generator().manual_seed(2))
    uniform[:2] = torch.tensor([0.0, 1.0 - 2 ** -24])  # both ends of [0, 1)
    tokens, logprobs, _ = kernel.draw(logits, 1.0, uniform)
    assert set(tokens.tolist()) == {0, 299}
    assert tokens[0] == 0 and tokens[1] == 299
    share = (tokens == 299).double().mean()
    assert abs(share - torch.sigmoid(torch.tensor(1.0, dtype=torch.float64))) < 0.03
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])


def test_sample_takes_the_kernel_for_fp32_cpu_logits(monkeypatch):
    assert sampling.draw_kernel(torch.zeros(2, 8)) is not None
    assert sampling.draw_kernel(torch.zeros(2, 8, dtype=torch.bfloat16)) is None
    logits = _logits(32, 3000, 3)
    seeded = SamplingParams(max_new_tokens=1, temperature=0.8, seed=0)
    with_kernel = sampler.sample(logits, seeded, torch.Generator().manual_seed(5))
    monkeypatch.setattr(sampler, "draw_kernel", lambda logits_kv: None)
    with_torch = sampler.sample(logits, seeded, torch.Generator().manual_seed(5))
    assert torch.equal(with_kernel.tokens_k, with_torch.tokens_k)  # same uniform numbers, same rule
    torch.testing.assert_close(with_kernel.logprobs_k, with_torch.logprobs_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(with_kernel.scaled_logprobs_k, with_torch.scaled_logprobs_k, rtol=0, atol=1e-5)
    filtered = SamplingParams(max_new_tokens=1, temperature=0.8, top_k=5, seed=0)
    drawn = sampler.sample(logits, filtered, torch.Generator().manual_seed(6))
    monkeypatch.undo()
    drawn_kernel = sampler.sample(logits, filtered, torch.Generator().manual_seed(6))
    assert torch.equal(drawn.tokens_k, drawn_kernel.tokens_k)
    assert all(tok in logits[row].topk(5).indices.tolist() for row, tok in enumerate(drawn_kernel.tokens_k.tolist()))

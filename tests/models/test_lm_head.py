"""Fused LM head: logprobs, entropy and both gradients, and the sum of squared probabilities, match the full-logits
reference (tp=1 and tp=2) to fp32 rounding (both paths compute the softmax in fp32; the gradients are formed
differently)."""

import pytest
import torch
import torch.distributed as dist

from rlhf.models.forward import token_entropy, token_logprobs
from rlhf.models.lm_head import LMHead, head_logprobs, head_sum_pi_squared
from rlhf.testing.distributed import run_distributed

ROWS, HIDDEN, VOCAB, PADDED = 37, 16, 203, 256  # odd sizes; 53 padding rows in the weight


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen, dtype=dtype)
    weight = torch.randn(PADDED, HIDDEN, generator=gen, dtype=dtype)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    grad_logp = torch.randn(ROWS, generator=gen, dtype=torch.float32)
    grad_entropy = torch.randn(ROWS, generator=gen, dtype=torch.float32)
    return hidden, weight, labels, grad_logp, grad_entropy


def _reference(hidden, weight, labels, grad_logp, grad_entropy, temperature, group, vocab=VOCAB):
    """The plain path: full [1, n, vocab] logits (padding included), then token_logprobs / token_entropy."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (hidden @ weight.t())[None]
    logp = token_logprobs(logits, labels[None], group, vocab, temperature)[0]
    entropy = token_entropy(logits, group, vocab, temperature)[0]
    ((logp * grad_logp).sum() + (entropy * grad_entropy).sum()).backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight.grad


def _fused(hidden, weight_shard, labels, grad_logp, grad_entropy, temperature, group, vocab=VOCAB, **kwargs):
    hidden, weight_shard = hidden.clone().requires_grad_(), weight_shard.clone().requires_grad_()
    logp, entropy = head_logprobs(hidden, labels, LMHead(weight_shard, group, vocab), temperature=temperature,
                                  entropy_grad=True, **kwargs)
    ((logp * grad_logp).sum() + (entropy * grad_entropy).sum()).backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight_shard.grad


def _compare_tp1():
    group = dist.new_group([0])
    hidden, weight, labels, grad_logp, grad_entropy = _inputs()
    out = {}
    for temperature in (1.0, 0.7):
        expected = _reference(hidden, weight, labels, grad_logp, grad_entropy, temperature, group)
        # one chunk (logits kept for the backward), several chunks (recomputed), tiny blocks
        for name, kwargs in (("kept", {}), ("recomputed", {"chunk_bytes": 5 * 4 * VOCAB}),
                             ("blocks", {"block_bytes": 3 * 4 * VOCAB})):
            got = _fused(hidden, weight, labels, grad_logp, grad_entropy, temperature, group, **kwargs)
            out[(temperature, name)] = [float((g - e).abs().max()) for g, e in zip(got, expected)]
        pi_squared = head_sum_pi_squared(hidden, LMHead(weight, group, VOCAB), temperature=temperature,
                                         chunk_bytes=5 * 4 * VOCAB)
        out[(temperature, "sum_pi_squared")] = [float((pi_squared - _sum_pi_squared(hidden, weight, VOCAB,
                                                                                   temperature)).abs().max())] * 4
    return out


def test_fused_head_matches_full_logits_path():
    diffs = run_distributed(_compare_tp1, 1, timeout_s=120)[0]
    for key, (logp, entropy, grad_hidden, grad_weight) in diffs.items():
        assert max(logp, entropy, grad_hidden, grad_weight) < 2e-5, (key, logp, entropy, grad_hidden, grad_weight)


def _metric_only_entropy():
    group = dist.new_group([0])
    hidden, weight, labels, grad_logp, _ = _inputs()
    hidden = hidden.requires_grad_()
    logp, entropy = head_logprobs(hidden, labels, LMHead(weight, group, VOCAB))
    (logp * grad_logp).sum().backward()
    return entropy.requires_grad, logp.dtype, entropy.dtype, bool(hidden.grad.abs().sum() > 0)


def test_entropy_is_a_metric_without_entropy_grad():
    assert run_distributed(_metric_only_entropy, 1, timeout_s=120)[0] == (False, torch.float32, torch.float32, True)


def _sum_pi_squared(hidden, weight, vocab, temperature):
    """sum_v p(v)^2 from the full logits over the real vocab (the optimal token baseline's input)."""
    return torch.softmax((hidden @ weight[:vocab].t()) / temperature, dim=-1).square().sum(-1)


def _compare_tp2():
    rank = dist.get_rank()
    tp_group = dist.new_group([0, 1])
    solo = dist.new_group([rank])
    hidden, weight, labels, grad_logp, grad_entropy = _inputs()
    shard = weight.chunk(2)[rank]
    out = []
    # vocab 203: rank 1 holds ids 128..255, 75 real and 53 padding rows; vocab 100: rank 1 holds only padding
    for vocab in (VOCAB, 100):
        labels = labels % vocab
        expected = _reference(hidden, weight, labels, grad_logp, grad_entropy, 0.9, solo, vocab)
        got = _fused(hidden, shard, labels, grad_logp, grad_entropy, 0.9, tp_group, vocab, chunk_bytes=8 * 4 * 128)
        expected_grad_shard = expected[3].chunk(2)[rank]
        pi_squared = head_sum_pi_squared(hidden, LMHead(shard, tp_group, vocab), temperature=0.9,
                                         chunk_bytes=8 * 4 * 128)
        out.append([float((pi_squared - _sum_pi_squared(hidden, weight, vocab, 0.9)).abs().max())])
        out.append([float((got[0] - expected[0]).abs().max()), float((got[1] - expected[1]).abs().max()),
                    float((got[2] - expected[2]).abs().max()), float((got[3] - expected_grad_shard).abs().max()),
                    float(got[3][max(0, vocab - 128 * rank):].abs().sum())])  # no gradient on padding rows
    return out


def test_fused_head_tp2_matches_unsharded():
    for rank_diffs in run_distributed(_compare_tp2, 2, timeout_s=120):
        for vocab_diffs in rank_diffs:
            assert max(vocab_diffs) < 2e-5, rank_diffs


def _no_rows():
    group = dist.new_group([0])
    hidden, weight, labels, _, _ = _inputs()
    hidden = hidden[:0].clone().requires_grad_()
    logp, entropy = head_logprobs(hidden, labels[:0], LMHead(weight, group, VOCAB))
    logp.sum().backward()
    return tuple(logp.shape), tuple(entropy.shape), tuple(hidden.grad.shape)


def test_no_rows():
    assert run_distributed(_no_rows, 1, timeout_s=120)[0] == ((0,), (0,), (0, HIDDEN))



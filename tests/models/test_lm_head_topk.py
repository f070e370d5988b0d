"""The fused head's top-K (distillation's `estimator: topk`): the teacher side's top-K ids and logprobs, and the
student side's logprobs at several given ids per row with their gradient, match the full log-softmax over the
logits (tp=1, and tp=2 with the vocab sharded over 2 gloo ranks) to 1e-5 (gradients: relative to their largest
entry)."""

import torch
import torch.distributed as dist

from rlhf.models.lm_head import LMHead, head_logprobs, head_topk
from rlhf.testing.distributed import run_distributed

ROWS, HIDDEN, VOCAB, PADDED, K = 37, 16, 203, 256, 8  # odd sizes; 53 padding rows in the weight


def _inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen)
    weight = torch.randn(PADDED, HIDDEN, generator=gen)
    ids = torch.randint(0, VOCAB, (ROWS, K + 1), generator=gen)  # the sampled token, then K ids to score
    grad = torch.randn(ROWS, K + 1, generator=gen)
    grad_entropy = torch.randn(ROWS, generator=gen)
    return hidden, weight, ids, grad, grad_entropy


def _full_logprobs(hidden, weight, vocab, temperature):
    return torch.log_softmax((hidden @ weight[:vocab].t()) / temperature, dim=-1)


def _reference_grads(hidden, weight, ids, grad, grad_entropy, vocab, temperature):
    """Autograd through the full [n, vocab] logits: d(sum grad x logp[ids] + grad_entropy x H) / d(hidden, weight)."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = _full_logprobs(hidden, weight, vocab, temperature)
    entropy = -(logp.exp() * logp).sum(-1)
    ((logp.gather(1, ids) * grad).sum() + (entropy * grad_entropy).sum()).backward()
    return logp.gather(1, ids).detach(), entropy.detach(), hidden.grad, weight.grad


def _relative(got, expected):
    """max |got - expected| over the expected's largest magnitude (gradients sum 9 terms a row: ~10 in size)."""
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1.0))


def _fused(hidden, shard, ids, grad, grad_entropy, group, vocab, temperature, **kwargs):
    hidden, shard = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
    logp, entropy = head_logprobs(hidden, ids, LMHead(shard, group, vocab), temperature=temperature,
                                  entropy_grad=True, **kwargs)
    ((logp * grad).sum() + (entropy * grad_entropy).sum()).backward()
    return logp.detach(), entropy.detach(), hidden.grad, shard.grad


def _topk_diffs(hidden, shard, group, vocab, temperature, k, **kwargs):
    """(max |logprob - full|, ids equal to the full logits' top-k, max |logprob at the ids - full|, max |logprob
    of each row's label - full|) of head_topk; without labels it returns None there."""
    labels = torch.arange(hidden.shape[0]) * 37 % vocab  # labels on every shard
    head = LMHead(shard, group, vocab)
    ids, logp, label_logp = head_topk(hidden, head, k, temperature=temperature, labels_n=labels, **kwargs)
    assert head_topk(hidden, head, k, temperature=temperature, **kwargs)[2] is None
    full = _full_logprobs(hidden, _inputs()[1], vocab, temperature)
    expected = full.topk(k, dim=-1)
    return float((logp - expected.values).abs().max()), bool(torch.equal(ids, expected.indices)), \
        max(float((logp - full.gather(1, ids)).abs().max()),
            float((label_logp - full.gather(1, labels[:, None])[:, 0]).abs().max()))


def _tp1():
    group = dist.new_group([0])
    hidden, weight, ids, grad, grad_entropy = _inputs()
    out = {}
    for temperature in (1.0, 0.7):
        expected = _reference_grads(hidden, weight, ids, grad, grad_entropy, VOCAB, temperature)
        for name, kwargs in (("kept", {}), ("recomputed", {"chunk_bytes": 5 * 4 * VOCAB}),
                             ("blocks", {"block_bytes": 3 * 4 * VOCAB})):
            got = _fused(hidden, weight, ids, grad, grad_entropy, group, VOCAB, temperature, **kwargs)
            out[(temperature, name)] = [_relative(g, e) for g, e in zip(got, expected)]
        for k in (1, K, VOCAB):
            out[(temperature, "topk", k)] = _topk_diffs(hidden, weight, group, VOCAB, temperature, k,
                                                       chunk_bytes=5 * 4 * VOCAB)
    # one id per row [n] and [n, 1] give the same logprob (the sampled token's path is unchanged)
    single = head_logprobs(hidden, ids[:, 0], LMHead(weight, group, VOCAB))[0]
    column = head_logprobs(hidden, ids[:, :1], LMHead(weight, group, VOCAB))[0]
    out["single"] = (tuple(single.shape), bool(torch.equal(single, column[:, 0])))
    return out


def test_topk_and_logprobs_at_ids_tp1():
    out = run_distributed(_tp1, 1, timeout_s=120)[0]
    assert out.pop("single") == ((ROWS,), True)
    for key, diffs in out.items():
        if key[1] == "topk":
            value_diff, same_ids, at_ids_diff = diffs
            assert same_ids and value_diff < 1e-5 and at_ids_diff < 1e-5, (key, diffs)
        else:
            assert max(diffs) < 1e-5, (key, diffs)


def _tp2():
    rank = dist.get_rank()
    tp_group = dist.new_group([0, 1])
    hidden, weight, ids, grad, grad_entropy = _inputs()
    shard = weight.chunk(2)[rank]
    out = []
    # vocab 203: rank 1 holds ids 128..255, 75 real and 53 padding rows; vocab 100: rank 1 holds only padding
    for vocab in (VOCAB, 100):
        vocab_ids = ids % vocab
        expected = _reference_grads(hidden, weight, vocab_ids, grad, grad_entropy, vocab, 0.9)
        got = _fused(hidden, shard, vocab_ids, grad, grad_entropy, tp_group, vocab, 0.9, chunk_bytes=8 * 4 * 128)
        out.append([_relative(got[0], expected[0]), _relative(got[1], expected[1]), _relative(got[2], expected[2]),
                    _relative(got[3], expected[3].chunk(2)[rank]),
                    float(got[3][max(0, vocab - 128 * rank):].abs().sum())])  # no gradient on padding rows
        for k in (1, K, vocab):  # k = vocab: more than one shard holds
            value_diff, same_ids, at_ids_diff = _topk_diffs(hidden, shard, tp_group, vocab, 0.9, k,
                                                            chunk_bytes=8 * 4 * 128)
            out.append([value_diff, 0.0 if same_ids else 1.0, at_ids_diff])
    return out


def test_topk_and_logprobs_at_ids_tp2():
    for rank_diffs in run_distributed(_tp2, 2, timeout_s=120):
        for diffs in rank_diffs:
            assert max(diffs) < 1e-5, rank_diffs
